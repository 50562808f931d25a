"""The per-phase model of one GRPO step: each phase a formula of the workload, the placement and the calibration,
nothing fitted to multi-GPU runs (the formulas: docs/placement.md). A model size the calibration lacks is
interpolated (or extrapolated) in parameters between the two nearest calibrated sizes, and flagged.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field

from colocated_grpo.bench.placement.shapes import shape_for


@dataclass(frozen=True)
class Workload:
    completions: int  # per step, all GPUs together
    prompt_tokens: float
    completion_tokens: float
    params_b: float


@dataclass(frozen=True)
class Placement:
    kind: str  # colocate, colocate_sleep, server
    gpus: int  # GPUs used, a server's included
    server_gpus: int = 0
    request: str = "fast"  # colocated request and sync: fast (ours), trl (TRL's own), mixed (fast outputs, TRL's sync)
    mem: float | None = None  # a colocated engine's memory share; None: its best share (predict)
    one_forward: bool = True  # placement.one_forward; False: TRL's extra no-grad forward over each generation batch

    @property
    def train_gpus(self) -> int:
        return self.gpus - self.server_gpus

    @property
    def engines(self) -> int:
        return self.server_gpus if self.kind == "server" else self.gpus

    @property
    def name(self) -> str:
        if self.kind == "server":
            return f"server {self.train_gpus}+{self.server_gpus}"
        label = "colocate + sleep" if self.kind == "colocate_sleep" else "colocate"
        share = "" if self.mem is None else f", share {self.mem:g}"
        return f"{label} {self.gpus} ({self.request}{share})"


@dataclass
class Prediction:
    placement: Placement
    phases: dict[str, float]
    fits: bool = True
    flags: list[str] = field(default_factory=list)

    @property
    def step_s(self) -> float:
        return sum(self.phases.values())

    def tokens_per_s_per_gpu(self, workload: Workload) -> float:
        tokens = workload.completions * (workload.prompt_tokens + workload.completion_tokens)
        return tokens / self.step_s / self.placement.gpus


def placements(gpus: int, request: str = "fast") -> list[Placement]:
    """The placements compared on `gpus` GPUs: colocate and colocate + sleep (TP 1, one engine per GPU), and
    server K+T for every K (TP 1 engines; TRL's request and sync, the only ones server mode has)."""
    colocated = {"request": request, "one_forward": request != "trl"}
    found = [Placement("colocate", gpus, **colocated), Placement("colocate_sleep", gpus, **colocated)]
    found += [Placement("server", gpus, server_gpus=k, request="trl") for k in range(1, gpus)]
    return found


# The memory shares a colocated engine is predicted at when none is given (Placement.mem None).
SHARES = tuple(round(0.05 * k, 2) for k in range(2, 19))  # 0.1 … 0.9


def same_size(params_b: float, other_b: float) -> bool:
    """Whether two parameter counts (billions) are one model size: within 5 % of `other_b`."""
    return abs(params_b - other_b) <= 0.05 * other_b


def uncalibrated(calibration: dict, params_b: float) -> str | None:
    """Why the calibration cannot predict a model of `params_b` (it has one other size only), or None."""
    sizes = [m["params_b"] for m in calibration["models"].values()]
    if len(sizes) == 1 and not same_size(sizes[0], params_b):
        return f"the calibration has one model size ({sizes[0]:.2f} B)"
    return None


def predict(calibration: dict, workload: Workload, placement: Placement) -> Prediction:
    """The phases of one step; a colocated placement without a memory share is predicted at its best share: the
    fastest that fits, the smallest of those within 1 % of it (vLLM's share changes only how many completions one
    KV cache holds at once, and what training keeps)."""
    m = _model_quantities(calibration, workload.params_b)
    if placement.kind == "server" or placement.mem is not None:
        return _predict(calibration["gpu"], m, workload, placement)
    shares = [dataclasses.replace(placement, mem=share) for share in SHARES]
    found = [_predict(calibration["gpu"], m, workload, at_share) for at_share in shares]
    fitting = [p for p in found if p.fits] or found[:1]
    fastest = min(p.step_s for p in fitting)
    return next(p for p in fitting if p.step_s <= fastest * 1.01)


def _predict(gpu: dict, m: dict, workload: Workload, placement: Placement) -> Prediction:
    """One placement at its memory share, from the model's quantities `m` (_model_quantities)."""
    flags = list(m["flags"])
    per_engine = workload.completions / placement.engines
    per_trainer = workload.completions / placement.train_gpus
    tokens_per_trainer = per_trainer * (workload.prompt_tokens + workload.completion_tokens)

    if placement.kind == "server":
        curve, mem = m["server_curve"], 0.9  # the server's engine has its GPU to itself
    else:
        outputs = "trl" if placement.request == "trl" else "fast"  # mixed: fast outputs, TRL's sync
        curve = m["generate"].get(outputs) or m["generate"]["trl"]
        mem = placement.mem
    sync_key = "fast" if placement.kind != "server" and placement.request == "fast" else "trl"
    sync = m["sync_s"].get(sync_key, m["sync_s"].get("trl", 0.0))
    # ring all-reduce of bf16 gradients, not overlapped with backward (an upper bound); none on one training GPU
    t = placement.train_gpus
    allreduce = 2 * (t - 1) / t * 2 * workload.params_b / gpu["allreduce_gb_s"]
    phases = {
        "generate": _generate_s(curve, per_engine, workload, m, gpu, mem, flags),
        "sync_weights": sync,
        "sleep_wake": m["sleep_wake_s"] if placement.kind == "colocate_sleep" else 0.0,
        "reward": m["reward_s_per_completion"] * per_trainer,
        "train": _line_s(m["train"], tokens_per_trainer) + allreduce,
        "other": _line_s(m["other"], tokens_per_trainer),
    }
    if not placement.one_forward:  # TRL's path (its request and extra forward), or the extra forward alone
        path = "trl_path" if placement.request == "trl" else "extra_forward"
        added = m["added_s_per_token"].get(path)
        if not added:
            flags.append(f"{path.replace('_', ' ')}: not measured by the calibration, left out")
        for phase, s_per_token in (added or {}).items():
            phases[phase] += s_per_token * tokens_per_trainer
    train_gb = m["train_gb"]
    held = None if train_gb is None else train_gb + (mem * gpu["memory_gb"] if placement.kind == "colocate" else 0.0)
    held_fits = held is None or held <= gpu["memory_gb"]
    if not held_fits:
        flags.append(f"does not fit: ~{held:.0f} GB on a training GPU (training ~{train_gb:.0f} GB + vLLM)")
    fits = held_fits and math.isfinite(phases["generate"])  # else the share holds no completion (flagged)
    return Prediction(placement, phases, fits, flags)


# vLLM's default largest CUDA-graph batch, min(2 × max_num_seqs, 512); larger decoding batches run without graphs
CUDA_GRAPH_MAX = 512


def _line_s(line: dict, tokens: float) -> float:
    """A fitted line's seconds for `tokens`, never below zero: a small negative intercept, interpolated between
    sizes or carried to another model size, must not make a phase take negative time."""
    return max(0.0, line["fixed_s"] + line["s_per_token"] * tokens)


def _generate_s(curve, batch, workload, m, gpu, mem, flags: list[str]) -> float:
    """Seconds one engine takes to generate `batch` completions; what it extrapolates is added to `flags`."""
    context = workload.prompt_tokens + workload.completion_tokens
    capacity = _kv_capacity(m, gpu, mem)
    if capacity is not None and capacity < context:
        flags.append(f"a memory share of {mem:g} leaves no room for one completion's KV cache")
        return math.inf
    waves = max(1, math.ceil(batch * context / capacity)) if capacity else 1
    if waves > 1:
        flags.append(f"the engine's KV cache holds {capacity:,.0f} tokens: {waves} waves of generation")
    wave = batch / waves
    step = _step_s(curve, wave)
    # Longer context than calibrated: every decoding step reads each sequence's KV cache once more per token.
    calibrated = m["prompt_tokens"] + m["completion_tokens"] / 2
    extra = wave * (workload.prompt_tokens + workload.completion_tokens / 2 - calibrated) * m["kv_bytes_per_token"]
    step += max(extra, 0.0) / (gpu["hbm_gb_s"] * 1e9)
    # The measured rates include the calibrated prompts' prefill: only longer (or shorter) prompts change it.
    prefill_flops = 2 * workload.params_b * 1e9 * batch * (workload.prompt_tokens - m["prompt_tokens"])
    prefill = prefill_flops / (gpu["peak_tflops"] * 1e12 * gpu["prefill_efficiency"])
    if batch > curve[-1][0] * 1.01:
        flags.append(f"{batch:.0f} completions per engine: past the calibrated {curve[-1][0]:.0f} (extrapolated)")
    if wave > CUDA_GRAPH_MAX:
        flags.append(
            f"{wave:.0f} sequences decode at once, past vLLM's largest CUDA graph ({CUDA_GRAPH_MAX} by default): "
            "on one H200, 1024 at once generated at half the rate per token of 256, which this model does not predict"
        )
    return waves * workload.completion_tokens * step + prefill


def _step_s(curve: list[list[float]], batch: float) -> float:
    """Seconds per decoding step of one engine at `batch` sequences: log-log interpolation of b / rate(b)."""
    points = [(b, b / rate) for b, rate in curve]
    if batch <= points[0][0]:
        return points[0][1]  # below the smallest batch: per-step overheads dominate (an upper bound)
    for (b0, t0), (b1, t1) in itertools.pairwise(points):
        if batch <= b1:
            w = math.log(batch / b0) / math.log(b1 / b0)
            return math.exp(math.log(t0) + w * (math.log(t1) - math.log(t0)))
    if len(points) == 1:
        return points[0][1] * batch / points[0][0]
    (b0, t0), (b1, t1) = points[-2], points[-1]
    return t1 + (batch - b1) * (t1 - t0) / (b1 - b0)  # past the largest batch: linear in b (compute-bound)


def _kv_capacity(m: dict, gpu: dict, mem: float) -> float | None:
    """Tokens one engine's KV cache holds at memory share `mem`: the calibrated capacity, rescaled for the share."""
    if not m.get("kv_cache_tokens"):
        return None
    weights_gb = 2 * m["params_b"]
    calibrated_gb = m["mem"] * gpu["memory_gb"] - weights_gb
    return m["kv_cache_tokens"] * max(mem * gpu["memory_gb"] - weights_gb, 0.0) / calibrated_gb


def _model_quantities(calibration: dict, params_b: float) -> dict:
    """The calibration's quantities for a model of `params_b`: a calibrated model's own (within 5 %), else each
    interpolated linearly in parameters between the two nearest calibrated models (flagged)."""
    models = sorted(calibration["models"].values(), key=lambda e: e["params_b"])
    if exact := [e for e in models if same_size(e["params_b"], params_b)]:
        entry = _filled(exact[0], models)
        return {**entry, "server_curve": _server_curve(entry), "flags": []}
    if why := uncalibrated(calibration, params_b):
        raise SystemExit(f"{params_b} B parameters: {why}; calibrate this one")
    a, b = sorted(sorted(models, key=lambda e: abs(e["params_b"] - params_b))[:2], key=lambda e: e["params_b"])
    a, b = _filled(a, models), _filled(b, models)
    w = (params_b - a["params_b"]) / (b["params_b"] - a["params_b"])
    near = b if params_b > b["params_b"] else a if params_b < a["params_b"] else {"sync_s": {}, "params_b": 1.0}

    def mix(x, y):
        return None if x is None or y is None else x + w * (y - x)

    gpu = calibration["gpu"]

    def step_s(bb, ta, tb):  # seconds per decoding step at batch bb, from model a's and model b's
        if params_b > b["params_b"]:  # larger than calibrated: the larger model plus the added weights' roofline
            added = (params_b - b["params_b"]) * 1e9
            return tb + added * max(2 / (gpu["hbm_gb_s"] * 1e9), 2 * bb / (gpu["peak_tflops"] * 1e12 * 0.4))
        return max(mix(ta, tb), min(ta, tb))

    def curve(ca, cb):  # at each batch both measured
        cb = dict(cb)
        return [[bb, bb / step_s(bb, bb / r, bb / cb[bb])] for bb, r in ca if bb in cb]

    kv_bytes_per_token = shape_for(params_b).kv_bytes_per_token
    generate = {k: curve(a["generate"][k], b["generate"][k]) for k in a["generate"] if k in b["generate"]}
    kind = "extrapolated" if not a["params_b"] <= params_b <= b["params_b"] else "interpolated"
    return {
        "params_b": params_b,
        "kv_bytes_per_token": kv_bytes_per_token,
        "prompt_tokens": a["prompt_tokens"],
        "completion_tokens": a["completion_tokens"],
        "mem": a["mem"],
        "kv_cache_tokens": max(a["mem"] * gpu["memory_gb"] - 2 * params_b, 0) * 1e9 / kv_bytes_per_token,
        "generate": generate,
        # never below the nearer calibrated model's sync scaled by parameters (the weights to move)
        "sync_s": {
            k: max(mix(a["sync_s"][k], b["sync_s"][k]), near["sync_s"].get(k, 0.0) * params_b / near["params_b"])
            for k in a["sync_s"]
            if k in b["sync_s"]
        },
        "sleep_wake_s": mix(a["sleep_wake_s"], b["sleep_wake_s"]),
        "train": {k: mix(a["train"][k], b["train"][k]) for k in ("fixed_s", "s_per_token")},
        "other": {k: mix(a["other"][k], b["other"][k]) for k in ("fixed_s", "s_per_token")},
        "reward_s_per_completion": mix(a["reward_s_per_completion"], b["reward_s_per_completion"]),
        "train_gb": mix(a["train_gb"] / a["params_b"], b["train_gb"] / b["params_b"]) * params_b
        if a.get("train_gb") and b.get("train_gb")
        else (a.get("train_gb") or b.get("train_gb") or 0) / a["params_b"] * params_b or None,
        "server_curve": curve(_server_curve(a), _server_curve(b)),
        "added_s_per_token": {
            path: {
                k: mix(a["added_s_per_token"][path].get(k, 0.0), b["added_s_per_token"][path].get(k, 0.0))
                for k in {**a["added_s_per_token"][path], **b["added_s_per_token"][path]}
            }
            for path in ("trl_path", "extra_forward")
        },
        "flags": [f"{params_b} B: {kind} from the calibrated {a['params_b']:.2f} B and {b['params_b']:.2f} B"],
    }


def _filled(entry: dict, models: list[dict]) -> dict:
    """A calibrated model's quantities, those it lacks (sleep/wake, training memory, what TRL's path adds) from
    another model (the last two scaled by parameters)."""
    entry = dict(entry)
    entry["added_s_per_token"] = dict(entry.get("added_s_per_token") or {})
    for path in ("trl_path", "extra_forward"):  # per token, a cost that grows with the model: scaled by parameters
        if not entry["added_s_per_token"].get(path):
            donor = next((e for e in models if (e.get("added_s_per_token") or {}).get(path)), None)
            scale = entry["params_b"] / donor["params_b"] if donor else 0.0
            entry["added_s_per_token"][path] = (
                {k: v * scale for k, v in donor["added_s_per_token"][path].items()} if donor else {}
            )
    if entry.get("sleep_wake_s") is None:
        entry["sleep_wake_s"] = next((e["sleep_wake_s"] for e in models if e.get("sleep_wake_s") is not None), 0.0)
    if entry.get("train_gb") is None:
        donor = next((e for e in models if e.get("train_gb")), None)
        entry["train_gb"] = donor["train_gb"] / donor["params_b"] * entry["params_b"] if donor else None
    return entry


def _factor(entry: dict) -> float:
    return (entry.get("server_engine") or {}).get("factor", 1.0)


def _server_curve(entry: dict) -> list[list[float]]:
    server = entry.get("server_engine") or {}
    return server["curve"] if "curve" in server else [[b, r * _factor(entry)] for b, r in entry["generate"]["trl"]]
