"""The outputs of the target table: the CSV fields, DIR/targets.csv and DIR/targets.md (tables ready to paste into
benchmarks/RESULTS.md), their cells and notes, and the one-line summary of a row printed as it is measured."""
from __future__ import annotations

import csv
from pathlib import Path

# benchmarks/ is on sys.path (the package's __init__ puts it there): the benchmark modules by bare name
from floor import WRITE_BANDWIDTH_TARGET

from .workloads import FUSED_FLOOR_TARGET, SPLITZ_OVER_RS_TARGET, VS_LOOP_TARGET


CSV_FIELDS = ("part", "workload", "label", "model", "split", "precision", "n0", "n", "images", "weights", "inputs",
              "device", "backend", "status", "ours_s_per_image", "baseline", "naive_s_per_image", "naive_batch",
              "ratio_vs_naive", "target_s", "target_rule", "target_met", "vs_loop_met", "fused_floor_met",
              "all_targets_met", "flops_per_sample", "conv_flops_per_sample", "matmul_flops_per_sample",
              "activation_elements_per_sample", "fused_activation_elements_per_sample", "input_elements_per_sample",
              "element_size", "activation_bytes_per_sample", "fused_activation_bytes_per_sample", "samples_per_image",
              "card", "peak", "bandwidth_Bps", "bandwidth_source", "compute_floor_s", "noise_per_sample",
              "normal_rate", "rng_floor_s", "memory_floor_s",
              "fused_memory_floor_s", "floor_s", "fused_floor_s", "ours_over_floor", "ours_over_fused_floor",
              "compiled_in_timed_region", "naive_compiled_in_timed_region", "engine_batch", "setup_s", "certified",
              "warmup_certified", "naive_certified", "gamma_evaluations_mean", "what", "cuda_ms", "triton_ms",
              "reference_ms", "cuda_vs_triton", "bytes_written", "copy_bandwidth_Bps", "cuda_write_Bps",
              "triton_write_Bps", "cuda_of_copy_bandwidth", "triton_of_copy_bandwidth", "write_bandwidth_met",
              "unfused_s_per_image", "fused_s_per_image", "fused_speedup", "eager_s_per_image", "graph_s_per_image",
              "graph_speedup", "compiled_s_per_image", "compile_speedup", "bisection_s_per_image",
              "gamma_batch_4_s_per_image", "gamma_batch_speedup", "cuda_graphs_setting", "eigvalsh_ms", "squaring_ms",
              "squaring_vs_eigvalsh",
              "bound_relative_difference", "batched_ms", "one_by_one_ms", "batched_vs_one_by_one",
              "one_by_one_s_per_image", "batched_s_per_image", "batched_speedup",
              "plain_kernels_s_per_image", "fused_kernels_s_per_image", "fused_kernels_speedup",
              "tapwise_ms", "gathered_ms", "gathered_vs_tapwise", "gram_relative_difference",
              "error")


def write_csv(data: dict, path: Path) -> None:
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for part, record in data.get("parts", {}).items():
            for row in record["rows"]:
                writer.writerow({"part": part, **row})


def _fmt(value, digits=3, suffix="") -> str:
    return "—" if value is None else f"{value:.{digits}f}{suffix}"


def markdown(data: dict) -> str:
    env = data.get("environment", {})
    lines = [f"Card: **{env.get('device')}**; torch {env.get('torch')}, triton {env.get('triton')}, CUDA "
             f"{env.get('cuda')}, cuDNN {env.get('cudnn')}, splitz_fast {env.get('splitz_fast')}, Python "
             f"{env.get('python')}; TF32 matmul {env.get('tf32_matmul')} / cuDNN {env.get('tf32_cudnn')} (PyTorch "
             "defaults, the same for ours and the loop).", ""]
    targets = data.get("parts", {}).get("targets")
    if targets:
        s = targets["settings"]
        searches = sorted({f"{r['gamma_search']} γ search, {r['bound_method']} bound" for r in targets["rows"]
                           if "gamma_search" in r}) or ["—"]
        lines += [f"### SPEC §5 targets end to end (`python -m benchmarks.targets`, {targets.get('started')})", "",
                  f"CERTIFY with n0 = {'per row (quick)' if s.get('quick') else s['n0']}, α = {s['alpha']}, σ = {s['sigma']}, "
                  f"sound bound and γ search included ({'; '.join(searches)}); {s['images']} image(s) per row after one warm-up image (excluded), seconds "
                  "per image = wall time of the set / images. Ours: `Smoother.certify_many` (engine batch measured; "
                  "bf16 rows run a bf16 `f_R`, a different base classifier). **Cohen et al. algorithm (naive loop)**: "
                  "their `Smooth.certify` as written (`x.repeat` → the whole fp32 eager model → counts on the host "
                  "→ Clopper–Pearson) plus the same sound radius search, its fastest batch, timed in the same process."
                  + (" **Quick mode: smoke-test numbers, not results.**" if s.get("quick") else ""), "",
                  floor_note(s), "",
                  "| workload, n | split | f_R | ours (s/image) | Cohen et al. algorithm (naive loop), s/image (batch) "
                  f"| vs loop (≥ {VS_LOOP_TARGET:g}×) | certified (γ evals; loop's) | GFLOP / sample "
                  "| activation MB / sample (unfused / fused) | compute floor (s/image; + RNG floor) "
                  "| memory floor (s/image; unfused / fused) | ours ÷ floor "
                  f"| ours ÷ fused floor (≤ {FUSED_FLOOR_TARGET:g}×) | time target (s/image) "
                  f"| met: time / ≥ {VS_LOOP_TARGET:g}× loop / ≤ {FUSED_FLOOR_TARGET:g}× fused floor "
                  "| compiled in timed region | f_R as CUDA graph (eager → graph per batch); fused copy (plain → fused); "
                  "compiled copy (current → compiled) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in targets["rows"]:
            name = f"{r.get('label')}, {r.get('n', 0):,}"
            if r.get("status") != "ok":
                lines.append(f"| {name} | s = {r.get('split')} | {r.get('precision', '—')} | {r.get('status')}: "
                             f"{r.get('error', '')} |" + " |" * 13)
                continue
            lines.append(
                f"| {name} ({r['weights']} weights, {r['inputs']}) | s = {r['split']} | {r['precision']} | "
                f"{_fmt(r['ours_s_per_image'], 4)} | {_fmt(r['naive_s_per_image'], 4)} ({r['naive_batch']}) | "
                f"{_fmt(r.get('ratio_vs_naive'), 2, '×')} | {r['certified']}/{r['images']} "
                f"({r['gamma_evaluations_mean']:.1f}; {r.get('naive_certified')}) | "
                f"{_sig(r.get('flops_per_sample'), 1e9)} | {_sig(r.get('activation_bytes_per_sample'), 1e6)} / "
                f"{_sig(r.get('fused_activation_bytes_per_sample'), 1e6)} | {_sig(r.get('compute_floor_s'))}"
                + (f" + {_sig(r['rng_floor_s'])}" if r.get("rng_floor_s") is not None and r.get("compute_floor_s") is not None
                   else "") + " | "
                f"{_sig(r.get('memory_floor_s'))} / {_sig(r.get('fused_memory_floor_s'))} | "
                f"{_fmt(r.get('ours_over_floor'), 1, '×')} | {_fmt(r.get('ours_over_fused_floor'), 1, '×')} | "
                f"≤ {_fmt(r.get('target_s'), 4)} ({r.get('target_rule', '—')}) | "
                f"{_verdict(r.get('target_met'))} / {_verdict(r.get('vs_loop_met'))} / "
                f"{_verdict(r.get('fused_floor_met'))} | {compiled_cell(r)} | {graph_cell(r)} |")
        rs_vs_splitz = splitz_over_rs(targets["rows"])
        if rs_vs_splitz:
            lines += ["", f"SPLITZ (s = 1) vs RS (s = 0) certification time, same model and device (target ≤ "
                      f"{SPLITZ_OVER_RS_TARGET}×):",
                      "", "| workload | f_R | RS s/image | SPLITZ s/image | SPLITZ / RS |", "|---|---|---|---|---|"]
            lines += [f"| {label} | {precision} | {rs:.4f} | {splitz:.4f} | {splitz / rs:.2f}× |"
                      for label, precision, rs, splitz in rs_vs_splitz]
        lines.append("")
    native = data.get("parts", {}).get("native")
    if native:
        lines += [f"### Settings and kernels compared on the device (`--part native`, {native.get('started')})", "",
                  "A/B rows: the setting under test, then the baseline; kernel rows: the CUDA kernel of csrc/, then "
                  "Triton, then eager PyTorch.", "",
                  "| what | setting under test / CUDA kernel | baseline / Triton | eager reference | speedup |",
                  "|---|---|---|---|---|"]
        for r in native["rows"]:
            if r.get("status") != "ok":
                lines.append(f"| {r.get('what')} | {r.get('status')} {r.get('error', '')} | | | |")
            elif "cuda_ms" in r:
                lines.append(f"| {r['what']} | {r['cuda_ms']:.3f} ms{write_cell(r, 'cuda')} | {r['triton_ms']:.3f} ms"
                             f"{write_cell(r, 'triton')} | {r['reference_ms']:.3f} ms | {r['cuda_vs_triton']:.2f}× |")
            elif "compared" in r:  # an A/B row: the second setting in the first column, its speedup last
                lines.append(ab_cell(r))
            else:
                lines.append(f"| {r['what']} | {r['status']} in {r.get('seconds', 0):.1f} s | | | |")
        lines.append("")
    return "\n".join(lines)


def write_cell(row: dict, kernel: str) -> str:
    """A noise kernel's write bandwidth after its time: `` (0.78 TB/s written, 25 % of copy)``, the fraction marked
    where the row's best kernel misses WRITE_BANDWIDTH_TARGET; empty for a row that writes no batch."""
    if "bytes_written" not in row:
        return ""
    fraction = row.get(f"{kernel}_of_copy_bandwidth")
    share = "" if fraction is None else f", {fraction:.0%} of copy" + ("" if row["write_bandwidth_met"] else " **(< "
                                                                        f"{WRITE_BANDWIDTH_TARGET:.0%})**")
    return f" ({row[f'{kernel}_write_Bps'] / 1e12:.2f} TB/s written{share})"


def ab_cell(row: dict) -> str:
    """The markdown line of an A/B row (``compared = [first, second]`` settings, each timed in seconds per image or,
    for a single bound, milliseconds): the second setting, the first, and the first's time over the second's."""
    first, second = row["compared"]
    unit, what = ("s/image", f"{row['what']} ({row['images']} images)") if "images" in row else ("ms", row["what"])
    digits = 4 if unit == "s/image" else 2

    def cell(label: str) -> str:
        value = row[f"{label}_s_per_image" if unit == "s/image" else f"{label}_ms"]
        return f"{label.replace('_', ' ')} {value:.{digits}f} {unit}"

    note = f" (bounds {row['bound_relative_difference']:.1e} apart)" if "bound_relative_difference" in row else ""
    return (f"| {what} | {cell(second)} | {cell(first)} | — | {row[row['speedup_key']]:.2f}× ({second.replace('_', ' ')} "
            f"vs {first.replace('_', ' ')}){note} |")


def _sig(value, scale: float = 1.0) -> str:
    return "—" if value is None else f"{value / scale:.3g}"


def _verdict(value) -> str:
    return "—" if value is None else ("yes" if value else "**no**")


def compiled_cell(row: dict) -> str:
    """``no``, or what the timed region compiled (ours; the loop's too if its timed region compiled)."""
    parts = []
    for prefix, who in (("", ""), ("naive_", "loop: ")):
        if row.get(f"{prefix}compiled_in_timed_region"):
            c = row.get(f"{prefix}timed_region_compiles", {})
            what = [f"{k.replace('_', ' ')} {v if not isinstance(v, list) else len(v)}" for k, v in c.items()
                    if v and k != "warmup_batch_shapes"]
            parts.append(f"**{who}yes** ({', '.join(what)})")
    return "; ".join(parts) or "no"


def floor_note(settings: dict) -> str:
    """What the cost and floor columns are (benchmarks/floor.py) and which card figures this run used."""
    card = settings.get("card")
    bandwidth = settings.get("copy_bandwidth_Bps")
    where = ("no card figures for this device: floors —" if not card else
             f"card figures: {card['name']} ({card['source']}): {card['bf16_flops'] / 1e12:.0f} TFLOP/s bf16, "
             f"{card['tf32_flops'] / 1e12:.0f} TF32, {card['fp32_flops'] / 1e12:.0f} fp32; memory "
             + (f"{bandwidth / 1e12:.2f} TB/s measured (1 GiB `copy_`, read + write) in this run" if bandwidth else
                f"{card['bandwidth'] / 1e12:.2f} TB/s, {card['bandwidth_source']}"))
    return ("Cost and floors (benchmarks/floor.py), per sample of `f_R` (the whole model at s = 0): FLOPs counted by "
            "`torch.utils.flop_counter.FlopCounterMode`; activation bytes = elements written by every aten op of "
            "the forward (views excluded, in-place ops included; f_R's input excluded) × the row's element size; "
            "fused = only the last output of each conv/linear + BN + pointwise (ReLU, bias, residual add) + pool "
            "chain. Per image of n0 + n samples: compute floor = FLOPs at the card's dense peak for the row's "
            "precision (bf16, TF32 or IEEE fp32, as the engine runs f_R); memory floor = activations "
            "written once and read once at the card's bandwidth; RNG floor = the normals the row draws (its latent's "
            "elements per sample) at the rate torch's generator drew them in this run (on the same units as f_R's "
            "arithmetic, so it adds to the compute floor); floor = max(compute + RNG, memory), fused floor = "
            f"max(compute + RNG, fused memory). {where}. Compiled in timed region: dynamo compiles, Triton JIT compiles or "
            "new Triton cache files during the timed run, or f_R batch shapes it saw that the warm-up did not (cuDNN "
            "benchmark mode would autotune them; benchmarks/compile_watch.py).")


def splitz_over_rs(rows) -> list[tuple[str, str, float, float]]:
    times = {(r["label"], r["precision"], r["split"]): r["ours_s_per_image"] for r in rows if r.get("status") == "ok"}
    return [(label, precision, rs, times[(label, precision, 1)])
            for (label, precision, split), rs in times.items() if split == 0 and (label, precision, 1) in times]


def graph_cell(row: dict) -> str:
    """The table's last column: whether the full batches replayed a CUDA graph (of the eager or the compiled copy),
    whether ``f_R``'s fused copy sampled, and whether the compiled copy did, each with the measurement behind it."""
    cells = []
    compiled_used = {(d["channels_last"], d["pooled"], d["fused"], d["batch"]) for d in row.get("compiled") or []
                     if d["used"]}
    for d in row.get("cuda_graphs") or []:
        if d.get("compiled") and (d["channels_last"], d["pooled"], d["fused"], d["batch"]) not in compiled_used:
            continue  # the graph of a compiled copy that was not used (its time is in the compiled cell)
        timing = (f" ({d['eager_s'] * 1e3:.2f} → {d['graph_s'] * 1e3:.2f} ms/batch)" if d.get("graph_s") is not None
                  else f" ({d['reason']})")
        label = "compiled graph " if d.get("compiled") else ("graph " if cells else "")
        cells.append(label + ("yes" if d["used"] else "no") + timing)
    for d in row.get("fused_kernels") or []:
        timing = (f" ({d['plain_s'] * 1e3:.2f} → {d['fused_s'] * 1e3:.2f} ms/batch)" if d.get("fused_s") is not None
                  else f" ({d['reason']})")
        cells.append("fused " + ("yes" if d["used"] else "no") + timing)
    for d in row.get("compiled") or []:
        timing = (f" ({d['eager_s'] * 1e3:.2f} → {d['compiled_s'] * 1e3:.2f} ms/batch, compiling {d['compile_s']:.0f} s)"
                  if d.get("compiled_s") is not None else f" ({d['reason']})")
        cells.append("compiled " + ("yes" if d["used"] else "no") + timing)
    return "; ".join(cells) or "—"


def summary(row: dict) -> str:
    if row.get("status") != "ok":
        return f"{row.get('label')} s={row.get('split')} {row.get('precision', '')}: {row.get('status')} " \
               f"{row.get('error', '')}"
    ratio = row.get("ratio_vs_naive")
    floor = row.get("ours_over_floor")
    return (f"{row['label']} s={row['split']} {row['precision']}: ours {row['ours_s_per_image']:.4f} s/image, "
            f"Cohen et al. algorithm (naive loop) {row['naive_s_per_image'] or float('nan'):.4f} s/image (batch "
            f"{row['naive_batch']}), {ratio or float('nan'):.2f}x, certified {row['certified']}/{row['images']}; "
            f"{row.get('flops_per_sample', float('nan')) / 1e9:.4g} GFLOP and "
            f"{row.get('activation_bytes_per_sample', float('nan')) / 1e6:.3g} MB of activations per sample; "
            + (f"{floor:.1f}x the floor, {row['ours_over_fused_floor']:.1f}x the fused floor; " if floor else
               "no floor (no card figures); ")
            + f"target {_fmt(row['target_s'], 4)} s: {_met(row.get('target_met'))}, >= {VS_LOOP_TARGET:g}x loop: "
            f"{_met(row.get('vs_loop_met'))}, <= {FUSED_FLOOR_TARGET:g}x fused floor: "
            f"{_met(row.get('fused_floor_met'))}"
            + ("; COMPILED IN THE TIMED REGION" if row.get("compiled_in_timed_region") else ""))


def _met(value) -> str:
    return "—" if value is None else ("met" if value else "NOT met")
