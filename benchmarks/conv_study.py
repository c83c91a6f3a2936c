"""Study: can the tutorial CNN's 3x3 VALID convolutions be written so XLA:CPU runs them faster?

Usage:
  .venv/bin/python benchmarks/conv_study.py convs [--rounds 7] [--reps 5]
      per-convolution forward+backward (conv1 28x28x1->32, conv2 13x13x32->64, batch 128
      and 256), every formulation with the Eigen compiler option on and off, interleaved in
      one process; prints medians of per-round ratios vs the default (lax conv + Eigen).
  .venv/bin/python benchmarks/conv_study.py check
      allclose of outputs and gradients (x, kernel) of every formulation vs lax.conv.
  .venv/bin/python benchmarks/conv_study.py step [--rounds 8] [--steps 3]
      the whole jit train step (global batch 256, Adam, f32, replicator's max-pool
      lowering) with flax nn.Conv replaced by each formulation, 1 and 2 fake devices
      (one worker process each, benchmarks/trials.py), interleaved; MFU from XLA cost
      analysis of the standard (lax conv) 1-device step and the f32 matmul-chain peak
      measured in the same run. --forms lax,nchw,big_nchw picks formulations (Eigen on);
      --lowerings fwd,big,all adds, per mode, a worker running the unchanged flax model
      with install_conv_lowering(mode) (conv_general_dilated lowered via NCHW on CPU).
  .venv/bin/python benchmarks/conv_study.py flags [--rounds 10]
      the default step with --xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED
      (and replicator's Eigen flag) in XLA_FLAGS, hand-written jit and Replicator.compile,
      1 and 2 devices, against the same workers without the scheduler flag.
  XLA_FLAGS=--xla_force_host_platform_device_count=2 \
  .venv/bin/python benchmarks/conv_study.py hlo --form nchw
      convolutions / transposes of the compiled 2-device step of one formulation.

Results (2026-11-22, 2 shared cores, see the study's report): every matmul formulation
loses (conv2 fwd+bwd on Eigen already runs at ~200 GFLOP/s; im2col 0.34-0.6x, shifted
0.22x, patches 0.09x per convolution; whole step 0.4-0.6x). conv1 alone gains up to 1.8x
with im2colg at batch 128, which the whole step does not show (0.86-1.05x). "nchw" and
"big_nchw" compile to the same Eigen NHWC convolutions, only in another order, and ran
1.6-1.7x faster on 2 devices: the HLO schedule, not the formulation. The same order comes
from --xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED with the model
unchanged: 2 devices 53 -> 30 ms/step (1.73x, 31% MFU), 1 device neutral, bitwise-equal
results. A conv lowering rule (install_conv_lowering) gives nothing (0.98-1.05x).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import trials  # noqa: E402

EIGEN = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}
DIMS = ("NHWC", "HWIO", "NHWC")
# extra XLA:CPU compiler options, added to EIGEN for a step candidate named "FORM+EXTRA"
EXTRAS = {
    "mteigen0": {"xla_cpu_multi_thread_eigen": False},
    "schedmem": {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"},
    "schedconc": {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_CONCURRENCY_OPTIMIZED"},
    "conc0": {"xla_cpu_enable_concurrency_optimized_scheduler": False},
    "conc1": {"xla_cpu_enable_concurrency_optimized_scheduler": True},
}
FORMS = ("lax", "nchw", "shifted", "im2col", "im2colg", "patches")


# ----------------------------------------------------------------- formulations


def _taps(x, kh, kw, oh, ow):
    return [x[:, dy : dy + oh, dx : dx + ow, :] for dy in range(kh) for dx in range(kw)]


def conv_lax(x, k):
    from jax import lax

    return lax.conv_general_dilated(x, k, (1, 1), "VALID", dimension_numbers=DIMS)


def conv_nchw(x, k):
    from jax import lax

    y = lax.conv_general_dilated(
        x.transpose(0, 3, 1, 2),
        k.transpose(3, 2, 0, 1),
        (1, 1),
        "VALID",
        dimension_numbers=("NCHW", "OIHW", "NCHW"),
    )
    return y.transpose(0, 2, 3, 1)


def conv_shifted(x, k):
    from jax import lax

    kh, kw, cin, cout = k.shape
    oh, ow = x.shape[1] - kh + 1, x.shape[2] - kw + 1
    out = None
    for t, part in enumerate(_taps(x, kh, kw, oh, ow)):
        term = lax.dot_general(part, k[t // kw, t % kw], (((3,), (0,)), ((), ())))
        out = term if out is None else out + term
    return out


def _im2col(x, kh, kw):
    import jax.numpy as jnp

    oh, ow = x.shape[1] - kh + 1, x.shape[2] - kw + 1
    return jnp.concatenate(_taps(x, kh, kw, oh, ow), axis=-1)  # (B, H', W', kh*kw*Cin)


def conv_im2col(x, k):
    from jax import lax

    kh, kw, cin, cout = k.shape
    return lax.dot_general(
        _im2col(x, kh, kw), k.reshape(kh * kw * cin, cout), (((3,), (0,)), ((), ()))
    )


def _make_im2colg():
    import jax
    import jax.numpy as jnp
    from jax import lax

    @jax.custom_vjp
    def conv(x, k):
        return conv_im2col(x, k)

    def fwd(x, k):
        return conv_im2col(x, k), (x, k)

    def bwd(res, g):
        x, k = res
        kh, kw, cin, cout = k.shape
        patches = _im2col(x, kh, kw)
        dk = lax.dot_general(patches, g, (((0, 1, 2), (0, 1, 2)), ((), ())))
        dk = dk.reshape(kh, kw, cin, cout)
        gp = jnp.pad(g, ((0, 0), (kh - 1, kh - 1), (kw - 1, kw - 1), (0, 0)))
        kf = k[::-1, ::-1].transpose(0, 1, 3, 2).reshape(kh * kw * cout, cin)
        dx = lax.dot_general(_im2col(gp, kh, kw), kf, (((3,), (0,)), ((), ())))
        return dx, dk

    conv.defvjp(fwd, bwd)
    return conv


def conv_patches(x, k):
    from jax import lax

    kh, kw, cin, cout = k.shape
    p = lax.conv_general_dilated_patches(x, (kh, kw), (1, 1), "VALID", dimension_numbers=DIMS)
    # patches' feature axis is ordered (Cin, kh, kw)
    kr = k.transpose(2, 0, 1, 3).reshape(cin * kh * kw, cout)
    return lax.dot_general(p, kr, (((3,), (0,)), ((), ())))


_IM2COLG = None


def get_conv(form: str):
    global _IM2COLG
    if form == "im2colg":
        if _IM2COLG is None:
            _IM2COLG = _make_im2colg()
        return _IM2COLG
    if form.startswith("mix_"):  # small-Cin convolutions (conv1) by form[4:], the rest by lax
        small = get_conv(form[4:])
        return lambda x, k: small(x, k) if k.shape[2] <= 4 else conv_lax(x, k)
    if form.startswith("big_"):  # convolutions with Cin > 4 (conv2) by form[4:], the rest by lax
        big = get_conv(form[4:])
        return lambda x, k: big(x, k) if k.shape[2] > 4 else conv_lax(x, k)
    return {
        "lax": conv_lax,
        "nchw": conv_nchw,
        "shifted": conv_shifted,
        "im2col": conv_im2col,
        "patches": conv_patches,
    }[form]


# ------------------------------------------------- the same as a CPU lowering rule


def install_conv_lowering(mode: str) -> None:
    """CPU lowering of conv_general_dilated through NCHW/OIHW/NCHW (transposes around it).

    ``mode``: "fwd": only NHWC/HWIO/NHWC convolutions with more than 4 input features
    (conv2's forward); "big": every non-canonical 2-D convolution whose lhs and rhs
    feature dimensions are both > 4 (conv2's forward, input and weight gradients);
    "all": every non-canonical 2-D convolution. Measured: no gain (0.98-1.05x).
    """
    import functools

    from jax import lax
    from jax._src.lax import convolution as conv_mod
    from jax.interpreters import mlir

    from replicator.spmd.cpu import _lowering_rule

    prim = conv_mod.conv_general_dilated_p
    default_rule = _lowering_rule(prim, "cpu")
    ident = (0, 1, 2, 3)

    def via_nchw(lhs, rhs, *, dimension_numbers, **params):
        dn = dimension_numbers
        y = prim.bind(
            lhs.transpose(dn.lhs_spec),
            rhs.transpose(dn.rhs_spec),
            dimension_numbers=lax.ConvDimensionNumbers(ident, ident, ident),
            **params,
        )
        inv = [dn.out_spec.index(i) for i in range(4)]
        return y.transpose(inv)

    def rule(ctx, lhs, rhs, *, dimension_numbers, **params):
        dn = dimension_numbers
        rhs_aval = ctx.avals_in[1]
        canonical = dn.lhs_spec == ident and dn.rhs_spec == ident and dn.out_spec == ident
        apply = len(dn.lhs_spec) == 4 and not canonical
        if mode == "fwd":
            apply &= (dn.lhs_spec, dn.rhs_spec, dn.out_spec) == (
                (0, 3, 1, 2),
                (3, 2, 0, 1),
                (0, 3, 1, 2),
            )
            apply &= rhs_aval.shape[2] > 4
        elif mode == "big":
            apply &= (
                rhs_aval.shape[dn.rhs_spec[1]] > 4 and ctx.avals_in[0].shape[dn.lhs_spec[1]] > 4
            )
        if apply:
            f = functools.partial(via_nchw, dimension_numbers=dn, **params)
            return mlir.lower_fun(f, multiple_results=False)(ctx, lhs, rhs)
        return default_rule(ctx, lhs, rhs, dimension_numbers=dn, **params)

    mlir.register_lowering(prim, rule, platform="cpu")


# ------------------------------------------------------------------ the model


def make_model(form: str):
    """The tutorial CNN with its convolutions computed by ``form`` (same parameter tree)."""
    import flax.linen as nn
    import jax.numpy as jnp

    conv = get_conv(form)

    class Conv(nn.Module):
        features: int

        @nn.compact
        def __call__(self, x):
            k = self.param(
                "kernel",
                nn.initializers.lecun_normal(),
                (3, 3, x.shape[-1], self.features),
                jnp.float32,
            )
            b = self.param("bias", nn.initializers.zeros_init(), (self.features,), jnp.float32)
            return conv(x, k) + b

    class StudyCNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            for features in (32, 64):
                x = Conv(features, name=f"Conv_{features // 32 - 1}")(x)
                x = nn.max_pool(nn.relu(x), (2, 2), strides=(2, 2))
            x = x.reshape(x.shape[0], -1)
            x = nn.relu(nn.Dense(64, name="Dense_0")(x))
            return nn.Dense(10, name="Dense_1")(x)

    return StudyCNN()


# ----------------------------------------------------------------- check


def check() -> None:
    import jax
    import numpy as np

    jax.config.update("jax_default_matmul_precision", None)
    rng = np.random.default_rng(0)
    ok = True
    for layer, (size, cin, cout) in {"conv1": (28, 1, 32), "conv2": (13, 32, 64)}.items():
        x = rng.standard_normal((16, size, size, cin), np.float32)
        k = rng.standard_normal((3, 3, cin, cout), np.float32) / 3
        g = rng.standard_normal((16, size - 2, size - 2, cout), np.float32)

        def run(form, x=x, k=k, g=g):
            fn = jax.jit(
                lambda x, k, g: (lambda y, vjp: (y, *vjp(g)))(*jax.vjp(get_conv(form), x, k)),
                compiler_options=EIGEN,
            )
            return [np.asarray(a) for a in fn(x, k, g)]

        ref = run("lax")
        for form in FORMS[1:]:
            got = run(form)
            errs = [
                float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30)) for a, b in zip(got, ref)
            ]
            close = all(
                np.allclose(a, b, rtol=1e-4, atol=1e-4 * np.max(np.abs(b)))
                for a, b in zip(got, ref)
            )
            ok &= close
            print(
                f"{layer} {form:8s} allclose={close} max rel err (y, dx, dk): "
                + ", ".join(f"{e:.1e}" for e in errs)
            )
    # whole model: same params -> same loss and grads
    import cnn_steps
    import optax

    batch = cnn_steps.synthetic_batch(64)
    ref_model = cnn_steps.make_model()
    params = ref_model.init(jax.random.key(0), batch["image"][:1])["params"]

    def loss(model, p):
        logits = model.apply({"params": p}, batch["image"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    ref = jax.jit(jax.value_and_grad(lambda p: loss(ref_model, p)), compiler_options=EIGEN)(params)
    for form in FORMS[1:]:
        m = make_model(form)
        got = jax.jit(jax.value_and_grad(lambda p, m=m: loss(m, p)), compiler_options=EIGEN)(params)
        close = all(
            jax.tree.leaves(
                jax.tree.map(lambda a, b: bool(np.allclose(a, b, rtol=1e-4, atol=1e-5)), got, ref)
            )
        )
        ok &= close
        print(
            f"model {form:8s} loss {float(got[0]):.6f} vs {float(ref[0]):.6f}, "
            f"grads allclose={close}"
        )
    print("ALL MATCH" if ok else "MISMATCH")


# ------------------------------------------------------------ per-convolution


def convs(rounds: int, reps: int) -> None:
    import jax
    import numpy as np

    from replicator.spmd.cpu import install_max_pool_lowering  # noqa: F401 (not needed here)

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import cpu_defaults

    cpu_defaults.keep_freed_memory()
    rng = np.random.default_rng(0)
    cases = {}
    for batch in (128, 256):
        for layer, (size, cin, cout) in {"conv1": (28, 1, 32), "conv2": (13, 32, 64)}.items():
            x = rng.random((batch, size, size, cin), np.float32)
            k = rng.random((3, 3, cin, cout), np.float32)
            g = rng.random((batch, size - 2, size - 2, cout), np.float32)
            n_grads = 1 if cin == 1 else 2  # conv1's input gradient is never needed
            flops = 2 * g.size * 9 * cin * (1 + n_grads)
            for form in FORMS:
                for opt_name, opt in (("eigen", EIGEN), ("ynn", None)):
                    conv = get_conv(form)
                    if cin == 1:
                        f = lambda x, k, g, conv=conv: (lambda y, vjp: (y, vjp(g)[0]))(
                            *jax.vjp(lambda k: conv(x, k), k)
                        )
                    else:
                        f = lambda x, k, g, conv=conv: (lambda y, vjp: (y, *vjp(g)))(
                            *jax.vjp(conv, x, k)
                        )
                    fn = jax.jit(f, compiler_options=opt)
                    args = [jax.device_put(a) for a in (x, k, g)]
                    jax.block_until_ready(fn(*args))
                    jax.block_until_ready(fn(*args))
                    cases[(batch, layer, form, opt_name)] = (fn, args, flops)
    keys = list(cases)
    times = {key: [] for key in keys}
    for r in range(rounds):
        shift = (r * 7) % len(keys)
        for key in keys[shift:] + keys[:shift]:
            fn, args, _ = cases[key]
            t0 = time.perf_counter()
            for _ in range(reps):
                out = fn(*args)
            jax.block_until_ready(out)
            times[key].append((time.perf_counter() - t0) / reps)
    print(
        f"load average {os.getloadavg()[0]:.1f}; {rounds} rounds x {reps} reps; "
        "fwd + bwd (conv1: dW only; conv2: dx and dW)"
    )
    print(
        "| batch | layer | formulation | option | ms (median) | GFLOP/s "
        "| speed-up vs lax+eigen, median [min-max] |"
    )
    print("|---|---|---|---|---|---|---|")
    for key in keys:
        batch, layer, form, opt = key
        base = times[(batch, layer, "lax", "eigen")]
        ratios = sorted(b / t for b, t in zip(base, times[key]))
        med = statistics.median(times[key])
        flops = cases[key][2]
        print(
            f"| {batch} | {layer} | {form} | {opt} | {med * 1e3:.2f} | {flops / med / 1e9:.0f} | "
            f"{statistics.median(ratios):.2f} [{ratios[0]:.2f}-{ratios[-1]:.2f}] |"
        )


# ------------------------------------------------------------------ whole step


def build(candidates: list[dict], lowering: str | None = None):
    """trials worker: the hand-written jit step per formulation (pool lowering installed).

    ``lowering``: install_conv_lowering(lowering) first (process-wide).
    """
    if lowering:
        install_conv_lowering(lowering)
    import cnn_steps
    import jax
    import optax
    import throughput

    from replicator.spmd.cpu import install_max_pool_lowering

    install_max_pool_lowering()
    devices = jax.devices()
    host_batch = cnn_steps.synthetic_batch(cnn_steps.GLOBAL_BATCH)
    ref = cnn_steps.make_model()
    params = jax.device_get(ref.init(jax.random.key(0), host_batch["image"][:1])["params"])
    out = {}
    for c in candidates:
        if c["form"] == "peak":
            out[c["label"]] = throughput.peak_candidate(c["n"])
            continue
        if c["form"] == "replicator_compile":  # settings from XLA_FLAGS; replicator's own off
            out[c["label"]] = cnn_steps.replicator_candidate(
                ref, host_batch, params, devices, "replicator_compile"
            )
            continue
        # "lax" is flax's own CNN; "laxcopy" the study module around lax conv (noise control)
        form, _, extra = c["form"].partition("+")
        model = ref if form == "lax" else make_model("lax" if form == "laxcopy" else form)
        options = {**EIGEN, **EXTRAS.get(extra, {})} if c["eigen"] else None
        out[c["label"]] = cnn_steps.handwritten_jit(
            model, host_batch, optax.adam(1e-3), params, devices, options
        )
    return out


STEP_FORMS = (
    ("lax", True),
    ("lax", False),
    ("shifted", True),
    ("im2col", True),
    ("im2colg", True),
    ("mix_im2colg", True),
    ("mix_shifted", True),
    ("nchw", True),
)


def step(rounds: int, steps: int, forms=STEP_FORMS, lowerings=()) -> None:
    specs = []
    for n in (1, 2):
        for low in lowerings:  # the standard model, conv lowering installed in its own process
            env = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={n}"}
            cand = [{"label": f"lowering-{low} eigen", "form": "lax", "eigen": True}]
            specs.append(
                (f"{n}dev-{low}", "conv_study", "build", {"candidates": cand, "lowering": low}, env)
            )
        cands = [
            {"label": f"{f} {'eigen' if e else 'ynn'}", "form": f, "eigen": e} for f, e in forms
        ]
        if n == 1:
            cands += [{"label": "peak 1024", "form": "peak", "n": 1024}]
        env = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={n}"}
        specs.append((f"{n}dev", "conv_study", "build", {"candidates": cands}, env))
    results, info = trials.run_workers(specs, rounds, steps)
    peak_key = "1dev/peak 1024"
    rates = [info[peak_key]["flops_per_call"] / t.wall_s for t in results if t.key == peak_key]
    peak = max(rates)
    model_flops = info["1dev/lax eigen"]["flops_per_device"]
    print(
        f"load average {os.getloadavg()[0]:.1f}; model FLOPs/step {model_flops / 1e9:.2f} G "
        f"(lax conv, 1 device); peak {peak / 1e9:.0f} GFLOP/s best round "
        f"(median {statistics.median(rates) / 1e9:.0f})"
    )
    print(
        "| devices | formulation | option | ms/step median [q1-q3] | images/s | MFU (best round) "
        "| speed-up vs lax+eigen same devices | XLA flops/device | temp MB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for key in info:
        if key == peak_key:
            continue
        dev, label = key.split("/")
        s = trials.time_stats(results, key)["wall_s"]
        ratio = trials.ratio_stats(results, key, f"{dev[:4]}/lax eigen")
        i = info[key]
        print(
            f"| {dev} | {label.split()[0]} | {label.split()[1]} | {s['median'] * 1e3:.1f} "
            f"[{s['q1'] * 1e3:.1f}-{s['q3'] * 1e3:.1f}] | {256 / s['median']:,.0f} | "
            f"{model_flops / s['median'] / peak:.0%} ({model_flops / s['min'] / peak:.0%}) | "
            f"{trials.fmt_ratio(ratio)} | {i['flops_per_device'] / 1e9:.2f} G | "
            f"{i['temp_bytes'] / 1e6:.0f} |"
        )


def hlo(form: str, n: int = 2) -> None:
    """Prints op statistics of the compiled step (run with the fake device count set)."""
    import collections
    import re

    c = build([{"label": "x", "form": form, "eigen": True}])["x"]
    text = c.hlo
    ops = collections.Counter(re.findall(r"= \S+ (\w+)\(", text))
    print(form, dict(ops.most_common(12)))
    for line in text.splitlines():
        if " convolution(" in line or " transpose(" in line or " copy(" in line:
            print("   ", line.strip()[:230])


SCHED_FLAG = "--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"


def flags(rounds: int, steps: int) -> None:
    """The scheduler option through XLA_FLAGS, hand-written jit and Replicator.compile."""
    import cpu_defaults

    specs = []
    for n in (1, 2):
        for sched in (False, True):
            xla = [f"--xla_force_host_platform_device_count={n}", cpu_defaults.XLA_FLAGS]
            xla += [SCHED_FLAG] if sched else []
            cands = [
                {"label": "jit", "form": "lax", "eigen": False},
                {"label": "replicator_compile", "form": "replicator_compile"},
            ]
            if n == 1 and not sched:
                cands.append({"label": "peak 1024", "form": "peak", "n": 1024})
            name = f"{n}dev{'-schedmem' if sched else ''}"
            specs.append(
                (name, "conv_study", "build", {"candidates": cands}, {"XLA_FLAGS": " ".join(xla)})
            )
    results, info = trials.run_workers(specs, rounds, steps)
    peak_key = "1dev/peak 1024"
    rates = [info[peak_key]["flops_per_call"] / t.wall_s for t in results if t.key == peak_key]
    peak, model_flops = max(rates), info["1dev/jit"]["flops_per_device"]
    print(
        f"load average {os.getloadavg()[0]:.1f}; peak {peak / 1e9:.0f} GFLOP/s best round; "
        f"model FLOPs/step {model_flops / 1e9:.2f} G"
    )
    print(
        "| worker (XLA_FLAGS) | step | ms/step median [q1-q3] | images/s | MFU (best round) "
        "| speed-up vs same step without the scheduler flag |"
    )
    print("|---|---|---|---|---|---|")
    for key in info:
        if key == peak_key:
            continue
        worker, label = key.split("/")
        s = trials.time_stats(results, key)["wall_s"]
        base = key.replace("-schedmem", "")
        ratio = trials.ratio_stats(results, key, base)
        print(
            f"| {worker} | {label} | {s['median'] * 1e3:.1f} [{s['q1'] * 1e3:.1f}-"
            f"{s['q3'] * 1e3:.1f}] | {256 / s['median']:,.0f} | "
            f"{model_flops / s['median'] / peak:.0%} ({model_flops / s['min'] / peak:.0%}) | "
            f"{trials.fmt_ratio(ratio)} |"
        )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("check", "convs", "step", "hlo", "flags"))
    p.add_argument("--form", default="lax")
    p.add_argument(
        "--lowerings",
        default="",
        help="step: comma-separated install_conv_lowering modes (fwd,big,all)",
    )
    p.add_argument(
        "--forms",
        default=None,
        help="step: comma-separated formulations (Eigen option on), e.g. lax,nchw",
    )
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()
    if a.mode == "check":
        check()
    elif a.mode == "convs":
        convs(a.rounds or 7, a.reps)
    elif a.mode == "flags":
        flags(a.rounds or 10, a.steps)
    elif a.mode == "hlo":
        hlo(a.form)
    else:
        forms = STEP_FORMS if a.forms is None else [(f, True) for f in a.forms.split(",")]
        step(a.rounds or 8, a.steps, forms, [x for x in a.lowerings.split(",") if x])


if __name__ == "__main__":
    main()
