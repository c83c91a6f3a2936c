"""The classify experiment's ViT, and Hugging Face ViT checkpoints into it and out of it.

Random tiny ``ViTForImageClassification`` / ``ViTModel`` checkpoints (every weight drawn
at random, LayerNorms and biases too, so a mapping that drops or swaps one shows) are
saved with ``save_pretrained`` and imported (``init_from='hf:DIR'``); the backbone's
tokens and the logits must equal HF's torch forward in float32, at the checkpoint's
image size and, through the position embeddings resampled at load time, at others
(HF's ``interpolate_pos_encoding=True``). A fine-tune through the trainer starts from
the imported backbone with a fresh head, and its export loads into transformers.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replicator as rp
from experiments.classify.hf import hf_checkpoint
from experiments.classify.vit import ViT, check_shape, resize_position_embedding
from replicator.errors import ConfigError
from replicator.parallel import sharding as sharding
from replicator.trainer import init_from, pretrained
from replicator.trainer.safetensors_files import SafetensorsDir
from tests.helpers.configs import CONFIG_DIR, load_config, read_records

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def vit_config(**kw):
    keys = dict(image_size=32, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2,
                num_attention_heads=2, intermediate_size=64, num_labels=3)  # fmt: skip
    return transformers.ViTConfig(**{**keys, **kw})


def save(model, directory) -> str:
    """``model`` with every weight random, saved as HF saves it; returns ``hf:DIR``."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model.eval().save_pretrained(directory, safe_serialization=True)
    return f"hf:{directory}"


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    model = transformers.ViTForImageClassification(vit_config())
    return model, save(model, tmp_path_factory.mktemp("vit"))


def plan_vit(spec, skip=None, **model_keys):
    """Our ViT as ``init_from`` shapes it, its abstract parameters on one device, and the
    plan (`pretrained.plan`: the checkpoint's headers only)."""
    _, hf_config = pretrained.read_hf_config(spec)
    keys = pretrained.layout("experiments.classify", model_keys, hf_config).model
    net = ViT(**{k: v for k, v in keys.items() if k != "arch"})
    images = np.zeros((1, keys["image_size"], keys["image_size"], keys["num_channels"]), np.float32)
    repl = rp.Replicator(devices=jax.devices()[:1])
    abstract = jax.eval_shape(lambda: net.init(jax.random.key(0), images))
    abstract = sharding.attach_shardings(abstract, repl.param_shardings(abstract))
    the_plan, source = pretrained.plan(spec, "experiments.classify", keys, abstract, skip)
    return net, images, abstract, the_plan, source


def import_vit(spec, skip=None, **model_keys):
    """Our ViT and its parameters as ``init_from`` loads them (`pretrained.plan`, `read`,
    `init_from.place`), on one device; what it does not load is zero (as the ViT's head
    starts: the trainer's own initialisation is left to the fine-tuning test)."""
    net, _, abstract, the_plan, source = plan_vit(spec, skip, **model_keys)
    fresh = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), abstract)
    params = init_from.place(the_plan, pretrained.read(the_plan, source, abstract), fresh)
    return net, params, the_plan


def forward(net, params, images_BxHxWxC):
    """Our (final LayerNorm's tokens, logits), compiled once (faster than op by op)."""
    both = lambda p, x: (net.apply(p, x, method=ViT.encode), net.apply(p, x))  # noqa: E731
    return tuple(np.asarray(y) for y in jax.jit(both)(params, images_BxHxWxC))


def hf_forward(model, images_BxHxWxC):
    """HF's (last_hidden_state, logits or None) of our [0, 1] NHWC images: HF takes
    [-1, 1] NCHW (its image processor's mean = std = 0.5)."""
    pixels = torch.tensor(images_BxHxWxC * 2 - 1).permute(0, 3, 1, 2)
    with torch.no_grad():
        base = getattr(model, "vit", model)
        tokens = base(pixel_values=pixels, interpolate_pos_encoding=True).last_hidden_state
        logits = (
            model(pixel_values=pixels, interpolate_pos_encoding=True).logits
            if base is not model
            else None
        )
    return tokens.numpy(), None if logits is None else logits.numpy()


@pytest.mark.parametrize("size", [32, 48, 16])  # the checkpoint's 4x4 grid, 6x6, 2x2
def test_imported_features_and_logits_equal_hf(classifier, size):
    model, spec = classifier
    net, params, the_plan = import_vit(spec, num_classes=3, image_size=size)
    assert not the_plan.fresh and not the_plan.unused, the_plan.details()
    images = np.random.default_rng(0).random((2, size, size, 3)).astype(np.float32)
    tokens, logits = hf_forward(model, images)
    got_tokens, got_logits = forward(net, params, images)
    np.testing.assert_allclose(got_tokens, tokens, rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(got_logits, logits, atol=2e-5)


def test_a_vit_model_checkpoint_and_another_head_size_leave_the_head_fresh(classifier, tmp_path):
    # A pooler, names without "vit.", no q/k/v biases, one channel, big_vision's epsilon.
    base = transformers.ViTModel(vit_config(num_channels=1, qkv_bias=False, layer_norm_eps=1e-6))
    spec = save(base, tmp_path)
    net, params, the_plan = import_vit(spec, num_classes=10, image_size=32)
    assert the_plan.fresh == ["params/head/bias/value", "params/head/kernel/value"]
    assert the_plan.unused == ["pooler.dense.bias", "pooler.dense.weight"]
    assert (
        "vit (ViTModel)" in the_plan.report()
        and "head fresh (a ViTModel has none)" in the_plan.report()
    )
    images = np.random.default_rng(1).random((2, 32, 32, 1)).astype(np.float32)
    tokens, _ = hf_forward(base, images)
    got_tokens, _ = forward(net, params, images)
    np.testing.assert_allclose(got_tokens, tokens, rtol=1e-5, atol=2e-5)
    # A classifier of another number of labels: its head is not loaded; init_from_skip
    # keeps one of the same size fresh too (big_vision's dont_load).
    _, spec = classifier
    for keys, skip in (({"num_classes": 10}, None), ({"num_classes": 3}, "params/head/")):
        the_plan = plan_vit(spec, skip, image_size=32, **keys)[3]
        assert [p.split("/")[1] for p in the_plan.fresh] == ["head", "head"], the_plan.details()
    assert "head fresh (3 labels in the checkpoint, 10 here)" in hf_checkpoint(
        {"num_classes": 10}, transformers.ViTConfig(num_labels=3, architectures=[
            "ViTForImageClassification"]).to_dict()
    ).summary  # fmt: skip


@pytest.mark.parametrize("side, grid", [(4, 2), (4, 7), (7, 3), (14, 1), (3, 3)])
def test_position_resampling_is_torch_bicubic(side, grid):
    table = np.random.default_rng(side).normal(size=(1 + side * side, 5)).astype(np.float32)
    got = resize_position_embedding(table, grid)
    patches = torch.tensor(table[1:]).reshape(1, side, side, 5).permute(0, 3, 1, 2)
    want = torch.nn.functional.interpolate(
        patches, size=(grid, grid), mode="bicubic", align_corners=False
    )
    np.testing.assert_allclose(got[1:], want.permute(0, 2, 3, 1).reshape(-1, 5), atol=1e-5)
    np.testing.assert_array_equal(got[0], table[0])  # the [CLS] row as it was


@pytest.mark.parametrize(
    "hf_config, message",
    [
        ({"model_type": "bert"}, "model_type='bert'"),
        ({"model_type": "vit", "hidden_act": "gelu_new"}, "hidden_act='gelu_new'"),
        ({"model_type": "vit", "image_size": [32, 16]}, "square images"),
    ],
)
def test_an_unsupported_checkpoint_is_one_config_error(hf_config, message):
    with pytest.raises(ConfigError, match=message):
        hf_checkpoint({"image_size": 32}, hf_config)


def test_shapes_that_do_not_tile_are_one_config_error():
    with pytest.raises(ConfigError, match="patch_size=16 does not divide"):
        check_shape(8, 16, 32, 2)
    with pytest.raises(ConfigError, match="num_heads=3 does not divide"):
        check_shape(8, 4, 32, 3)
    with pytest.raises(ConfigError, match="image_size=None"):
        check_shape(None, 4, 32, 2)
    with pytest.raises(ConfigError, match="exports its ViT"):
        hf_checkpoint({"arch": "cnn"})


@pytest.mark.slow  # a trainer run (35-50 s on 2 loaded cores); the mapping's tests are fast
def test_fine_tune_an_import_on_digits_then_export_to_transformers(
    tmp_path, digits_data_dir, capsys
):
    """A grayscale checkpoint of 16x16 images (8x8 patches of 2) fine-tuned on the 8x8
    scans (4x4 patches): positions resampled, the head of 3 labels fresh for 10 classes."""
    from replicator import trainer
    from replicator.trainer.export import export_hf

    hf_config = vit_config(image_size=16, patch_size=2, num_channels=1)
    spec = save(transformers.ViTForImageClassification(hf_config), tmp_path / "hf")
    original = SafetensorsDir(str(tmp_path / "hf"))
    config = load_config(CONFIG_DIR / "digits_vit.py", "smoke")
    config.update(init_from=spec, data_dir=digits_data_dir, num_train_steps=2, log_every_steps=1,
                  eval_every_steps=2, checkpoint_every_steps=2, learning_rate=1e-3)  # fmt: skip
    workdir = str(tmp_path / "run")
    trainer.train_and_evaluate(config, workdir, quiet=True, devices=jax.devices()[:1])
    err = capsys.readouterr().err
    assert "positions 8x8 -> 4x4 (bicubic), head fresh (3 labels in the checkpoint, 10 here)" in err
    assert "loaded 30 arrays, 2 initialised fresh, 2 in the checkpoint unused" in err
    losses = [r["loss"] for r in read_records(workdir) if "split" not in r]
    assert len(losses) == 2 and losses[0] == pytest.approx(math.log(10), abs=1e-5)  # zero head
    out = tmp_path / "out"
    exported = export_hf(workdir, str(out), devices=jax.devices()[:1])
    assert exported.step == 2 and "head of 10 classes" in exported.summary
    loaded, info = transformers.ViTForImageClassification.from_pretrained(
        str(out), output_loading_info=True
    )
    assert not any(info.values()), info
    assert loaded.config.image_size == 8 and loaded.config.num_labels == 10
    kernel = "vit.embeddings.patch_embeddings.projection.weight"
    moved = np.abs(loaded.state_dict()[kernel].numpy() - np.asarray(original.read(kernel)))
    assert 0 < moved.max() <= 3e-3  # from the checkpoint's, two Adam steps of 1e-3
    assert np.abs(loaded.state_dict()["classifier.weight"].numpy()).max() > 0  # trained head
    # Our model on the exported weights (re-imported) computes what transformers does.
    net, params, _ = import_vit(f"hf:{out}", num_classes=10, image_size=8)
    images = np.random.default_rng(2).random((3, 8, 8, 1)).astype(np.float32)
    _, logits = hf_forward(loaded.eval(), images)
    np.testing.assert_allclose(forward(net, params, images)[1], logits, atol=2e-5)


def test_the_sharding_rules_split_the_vit_as_they_split_the_lm():
    """Logical axes: the width over fsdp, heads and the MLP's hidden width over tensor."""
    net = ViT(num_classes=10, image_size=8, patch_size=2, embed_dim=32, num_layers=1,
              num_heads=2, mlp_dim=64, num_channels=1)  # fmt: skip
    abstract = jax.eval_shape(lambda: net.init(jax.random.key(0), jnp.zeros((1, 8, 8, 1))))
    repl = rp.Replicator(mesh={"data": 2, "fsdp": 2, "tensor": 2}, min_size=0)
    specs = {
        jax.tree_util.keystr(path, simple=True, separator="/"): tuple(s.spec) + (None,) * 4
        for path, s in jax.tree_util.tree_flatten_with_path(repl.param_shardings(abstract))[0]
    }
    block = "params/block_0/"
    assert specs[block + "attention/qkv_kernel/value"][:4] == ("fsdp", None, "tensor", None)
    assert specs[block + "attention/out_kernel/value"][:3] == ("tensor", None, "fsdp")
    assert specs[block + "mlp/fc/kernel/value"][:2] == ("fsdp", "tensor")
    assert specs[block + "mlp/proj/kernel/value"][:2] == ("tensor", "fsdp")
    assert specs["params/position_embedding/value"][:2] == (None, "fsdp")
    assert specs["params/patch_embedding/kernel/value"][:4] == (None, None, None, "fsdp")
