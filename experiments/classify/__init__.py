"""Image classification: the tf.distribute tutorial CNN with softmax cross-entropy."""

from experiments.classify.model import CNN as CNN
from experiments.classify.task import init_params as init_params
from experiments.classify.task import make_eval_step as make_eval_step
from experiments.classify.task import make_model as make_model
from experiments.classify.task import make_train_step as make_train_step
from experiments.classify.task import preprocess as preprocess
