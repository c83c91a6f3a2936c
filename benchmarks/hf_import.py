"""Peak host memory of importing a Hugging Face Llama checkpoint (``init_from='hf:DIR'``).

Writes a random ``LlamaForCausalLM`` checkpoint of the chosen shape in HF's layout
(bf16 safetensors, sharded with an index, as the hub ships them; torch from the
``test`` extra writes bf16), then, in a fresh process with 8 fake CPU devices and an
FSDP mesh, builds the run's abstract state and imports the checkpoint the way the
trainer does (`replicator.trainer.pretrained`: tensors streamed one at a time into
their shards). It reports the process's peak resident memory above what it held
before the import, next to the float32 parameters' bytes and the largest tensor.

On CPU the "devices" are host memory, so the parameters themselves count here; on a
TPU or GPU host they live on the accelerators and the host's share is the streaming
overhead (peak minus parameters). An 8B does not fit this 24 GiB machine as float32
parameters on CPU devices (32 GB), so the 8B figure in docs/benchmarks.md is that
overhead measured here at 1B, with the 8B's largest tensor.

    .venv/bin/python benchmarks/hf_import.py            # Llama 3.2 1B's shape
    .venv/bin/python benchmarks/hf_import.py --small    # a 60M one, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

SHAPES = {
    "llama3_1b": dict(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    ),  # fmt: skip
    "small": dict(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),  # fmt: skip
}


def write_checkpoint(directory: str, shape: dict, shard_layers: int = 4) -> int:
    """A random checkpoint in HF's layout; returns its bytes on disk."""
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    e, m, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    h, k = shape["num_attention_heads"], shape["num_key_value_heads"]
    d = e // h
    rand = lambda *s: (torch.randn(*s) * 0.02).to(torch.bfloat16)  # noqa: E731
    files, index, total = [], {}, 0

    def flush(tensors: dict) -> None:
        nonlocal total
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(tensors, os.path.join(directory, name), metadata={"format": "pt"})
        files.append(name)
        index.update({t: name for t in tensors})
        total += os.path.getsize(os.path.join(directory, name))

    flush({"model.embed_tokens.weight": rand(v, e), "model.norm.weight": torch.ones(e).bfloat16()})
    if not shape["tie_word_embeddings"]:
        flush({"lm_head.weight": rand(v, e)})
    layers = shape["num_hidden_layers"]
    for first in range(0, layers, shard_layers):
        tensors = {}
        for i in range(first, min(layers, first + shard_layers)):
            p = f"model.layers.{i}."
            tensors.update({
                p + "self_attn.q_proj.weight": rand(h * d, e),
                p + "self_attn.k_proj.weight": rand(k * d, e),
                p + "self_attn.v_proj.weight": rand(k * d, e),
                p + "self_attn.o_proj.weight": rand(e, h * d),
                p + "mlp.gate_proj.weight": rand(m, e),
                p + "mlp.up_proj.weight": rand(m, e),
                p + "mlp.down_proj.weight": rand(e, m),
                p + "input_layernorm.weight": torch.ones(e).bfloat16(),
                p + "post_attention_layernorm.weight": torch.ones(e).bfloat16(),
            })  # fmt: skip
        flush(tensors)
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": index}, f)
    config = dict(shape, model_type="llama", architectures=["LlamaForCausalLM"],
                  rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
                  hidden_act="silu", torch_dtype="bfloat16")  # fmt: skip
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return total


_CHILD = r"""
import json, os, resource, sys, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp
import replicator as rp
from replicator.parallel import sharding as sharding
from replicator.trainer import init_from, pretrained
from experiments.lm.task import make_model

spec = "hf:" + sys.argv[1]
_, hf_config = pretrained.read_hf_config(spec)
model = pretrained.layout("experiments.lm", {"max_len": 128, "attention": "xla"}, hf_config).model
net = make_model(model)
repl = rp.Replicator(mesh={"fsdp": 8})
abstract = jax.eval_shape(lambda: net.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
abstract = sharding.attach_shardings(abstract, repl.param_shardings(abstract))
leaves = jax.tree.leaves(abstract)
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
before, start = rss(), time.perf_counter()
the_plan, source = pretrained.plan(spec, "experiments.lm", model, abstract)
params = init_from.place(the_plan, pretrained.read(the_plan, source, abstract), abstract)
jax.block_until_ready(params)
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps(dict(
    parameters=sum(x.size for x in leaves),
    param_bytes=sum(x.size * x.dtype.itemsize for x in leaves),
    largest_tensor_bytes=max(x.size * x.dtype.itemsize for x in leaves),
    rss_before=before, peak_rss=peak, import_s=seconds)))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a 60M model instead of 1B")
    args = parser.parse_args()
    name = "small" if args.small else "llama3_1b"
    with tempfile.TemporaryDirectory() as directory:
        start = time.perf_counter()
        file_bytes = write_checkpoint(directory, SHAPES[name])
        written_s = time.perf_counter() - start
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        done = subprocess.run([sys.executable, "-c", _CHILD, directory], cwd=root,
                              capture_output=True, text=True, check=True)  # fmt: skip
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result.update(shape=name, file_bytes=file_bytes, write_s=written_s)
    over = result["peak_rss"] - result["rss_before"]
    gib = 2.0**30
    print(f"{name}: {result['parameters'] / 1e9:.2f}B parameters, {file_bytes / gib:.2f} GiB "
          f"of bf16 safetensors -> {result['param_bytes'] / gib:.2f} GiB of float32 on 8 CPU "
          f"devices in {result['import_s']:.1f} s")  # fmt: skip
    print(f"peak resident memory {over / gib:.2f} GiB above the start: the parameters plus "
          f"{(over - result['param_bytes']) / gib:.2f} GiB (largest tensor "
          f"{result['largest_tensor_bytes'] / gib:.2f} GiB)")  # fmt: skip
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "hf_import.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
