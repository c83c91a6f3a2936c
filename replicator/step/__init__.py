"""What one train step is made of: the train state, the optimizer wrappers and the
transforms between them, precision and loss scaling, rematerialisation, offload,
losses with global-batch semantics, an EMA of the parameters."""
