"""The ``fp8gate`` command line.

Every subcommand is registered by one ``_add_<name>(subparsers)`` function listed
in ``_COMMANDS``. An ``_add_`` function builds its parser (calling
``_output_options`` for ``--json``) and sets ``run`` to a function taking the
parsed arguments and returning the exit status; ``emit`` prints its result.
Raising any of the project's errors (``errors.Fp8GateError``, e.g. CommandError),
or OSError for unreadable files, prints one ``fp8gate: error: ...`` line and
exits with status 2 where the input is at fault (a usage error), else 1.

``--json`` output is strict JSON (RFC 8259 has no NaN or Infinity): a NaN
becomes ``null``, an infinity the string ``"inf"`` or ``"-inf"``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .. import hardware
from ..core import roofline
from ..core.answers import compare_answers
from ..core.buckets import DEFAULT_EDGES, chunk_positions
from ..core.dumps import dump_run_id, read_lm_eval_samples, read_logprob_dump, samples_run_id
from ..core.logprobs import compare_logprobs
from ..errors import CommandError, ComparisonError, Fp8GateError

__all__ = ["CommandError", "build_parser", "emit", "main"]

EXIT_ERROR = 2  # argparse's status for a usage error
EXIT_FAILURE = 1


def _output_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="Print JSON instead of a table")


def emit(
    args: argparse.Namespace, payload: Mapping[str, Any], rows: Iterable[tuple[str, str]]
) -> None:
    """Print ``payload`` as JSON under --json, else ``rows`` as an aligned table."""
    if args.json:
        print(json.dumps(_strict_json(payload), indent=2, allow_nan=False))
        return
    rows = list(rows)
    width = max((len(label) for label, _ in rows), default=0)
    for label, value in rows:
        print(f"{label:<{width}}  {value}".rstrip())


def _strict_json(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, Mapping):
        return {key: _strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(item) for item in value]
    return value


def _same_run(base: str, cand: str, run_id: Callable[[str], str | None]) -> None:
    """Refuse to pair artifacts that two different gate runs wrote (files without a run id pair freely)."""
    base_id, cand_id = run_id(base), run_id(cand)
    if base_id is not None and cand_id is not None and base_id != cand_id:
        raise CommandError(f"{cand}: written by gate run {cand_id}, but baseline {base} by run {base_id}; "
                           "artifacts of two different runs are not compared")


def _kl(value: float | None) -> str:
    return "-" if value is None else f"{value:.6f}"


def _pct(fraction: float, digits: int = 3) -> str:
    return f"{100 * fraction:.{digits}f}%"


def _add_compare_logprobs(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "compare-logprobs",
        help="Compare two log-prob dumps of the same text",
        description=(
            "Compare a candidate's log-prob dump with the baseline's on the same "
            "tokens: same top token, delta-p, perplexity ratio and KL divergence. "
            "Reads the article's JSON dumps or fp8gate .npz dumps."
        ),
    )
    parser.add_argument("base", help="Baseline dump (e.g. the BF16 run)")
    parser.add_argument("cand", help="Candidate dump (e.g. the FP8 run)")
    parser.add_argument("--chunk-tokens", type=int, metavar="N",
                        help="The dumps hold chunks of N tokens one after another (probabilities.chunk_tokens): "
                             "also give the figures per position bucket")
    parser.add_argument("--bucket-edges", type=_edges, default=DEFAULT_EDGES, metavar="A,B,...",
                        help="Where position buckets start, in tokens (probabilities.bucket_edges; default "
                             f"{','.join(map(str, DEFAULT_EDGES))})")
    _output_options(parser)
    parser.set_defaults(run=_run_compare_logprobs)


def _edges(text: str) -> tuple[int, ...]:
    try:
        edges = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected rising positive integers separated by commas, got {text!r}")
    if any(e < 1 for e in edges) or any(b <= a for a, b in zip(edges, edges[1:])):
        raise argparse.ArgumentTypeError(f"expected rising positive integers separated by commas, got {text!r}")
    return edges


def _run_compare_logprobs(args: argparse.Namespace) -> int:
    _same_run(args.base, args.cand, dump_run_id)
    base = read_logprob_dump(args.base)
    cand = read_logprob_dump(args.cand)
    try:
        positions = None if args.chunk_tokens is None else chunk_positions(base.positions, args.chunk_tokens)
        result = compare_logprobs(base, cand, positions, args.bucket_edges)
    except ComparisonError as err:
        raise CommandError(f"{args.cand}: {err} (baseline {args.base})") from err
    rows = [
        ("positions", str(result.positions)),
        ("same top token", f"{_pct(result.same_top)} ± {_pct(result.same_top_se)}"),
        ("mean Δp", f"{_pct(result.mean_dp)} ± {_pct(result.mean_dp_se)}"),
        ("RMS Δp", _pct(result.rms_dp)),
        ("PPL ratio", f"{result.ppl_ratio:.6f}"),
        ("ln PPL ratio", f"{result.ln_ppl_ratio:.6f} ± {result.ln_ppl_ratio_se:.6f}"),
    ]
    if result.mean_kl is None or result.kl_percentiles is None:
        rows.append(("KL divergence", result.kl_kind))
    else:
        rows.append(
            ("KL divergence", f"{result.mean_kl:.6f} ± {result.kl_se:.6f} ({result.kl_kind})")
        )
        rows += [(f"KL {label}", f"{value:.6f}") for label, value in result.kl_percentiles.items()]
    rows += [(f"Δp {label}", _pct(value)) for label, value in result.dp_percentiles.items()]
    rows += [(f"bucket {b.label}", f"{b.comparison.positions} positions, same top {_pct(b.comparison.same_top)}, "
                                   f"RMS Δp {_pct(b.comparison.rms_dp)}, KL {_kl(b.comparison.mean_kl)}, "
                                   f"PPL ratio {b.comparison.ppl_ratio:.6f}") for b in result.buckets]
    emit(args, result.as_dict(), rows)
    return 0


def _add_flips(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "flips",
        help="Count answers that flipped between two lm-eval runs",
        description=(
            "Pair two lm-eval --log_samples files question by question and count "
            "answers that went right-to-wrong or wrong-to-right."
        ),
    )
    parser.add_argument("base", help="Baseline samples JSONL")
    parser.add_argument("cand", help="Candidate samples JSONL")
    parser.add_argument(
        "--filter", default="strict-match", help="lm-eval filter to compare (default: %(default)s)"
    )
    parser.add_argument(
        "--metric", default=None, help="0/1 metric to read (default: first in each row's metrics)"
    )
    _output_options(parser)
    parser.set_defaults(run=_run_flips)


def _run_flips(args: argparse.Namespace) -> int:
    _same_run(args.base, args.cand, samples_run_id)
    base = read_lm_eval_samples(args.base, args.filter, args.metric)
    cand = read_lm_eval_samples(args.cand, args.filter, args.metric)
    try:
        result = compare_answers(base, cand)
    except ComparisonError as err:
        raise CommandError(f"{args.cand}: {err} (baseline {args.base})") from err
    rows = [
        ("questions", str(result.questions)),
        ("flips", f"{result.flips} ({_pct(result.flip_rate, 1)})"),
        ("right → wrong", str(result.right_to_wrong)),
        ("wrong → right", str(result.wrong_to_right)),
        ("accuracy baseline", f"{_pct(result.accuracy_base)} ± {_pct(result.se_base)}"),
        ("accuracy candidate", f"{_pct(result.accuracy_cand)} ± {_pct(result.se_cand)}"),
        ("McNemar exact p", f"{result.mcnemar_p:.4g}"),
    ]
    rows += [
        (f"doc {f.doc_id}", f"{f.direction}: {f.base_response!r} -> {f.cand_response!r}")
        for f in result.flipped
    ]
    emit(args, result.as_dict(), rows)
    return 0


def _add_roofline(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "roofline",
        help="Decode-speed ceiling from memory bandwidth",
        description=(
            "Estimate bytes read per decoded token from a model's config and the "
            "tokens/s ceiling that memory bandwidth allows."
        ),
    )
    parser.add_argument("path", help="Model directory or its config.json")
    parser.add_argument(
        "--quantization", default=None, help="Quantization name, e.g. fp8_per_channel"
    )
    bandwidth = parser.add_mutually_exclusive_group()
    bandwidth.add_argument("--gpu", default=None,
                           help='Known GPU name, e.g. L40S, or "auto" for the first visible CUDA device')
    bandwidth.add_argument(
        "--bandwidth-gbps", type=float, default=None, help="Memory bandwidth in GB/s"
    )
    parser.add_argument(
        "--context", type=int, default=0, help="Context tokens whose KV cache is read per token"
    )
    parser.add_argument("--kv-cache-dtype", default=None, help="vLLM kv_cache_dtype, e.g. fp8 (default: the model's)")
    parser.add_argument("--batch", type=int, default=1,
                        help="Sequences decoded together: each one's KV cache, and nEff experts of a MoE, per step")
    _output_options(parser)
    parser.set_defaults(run=_run_roofline)


def _run_roofline(args: argparse.Namespace) -> int:
    gpu = args.gpu and hardware.resolve_gpu_name(args.gpu)
    if args.gpu and gpu is None:
        raise CommandError(f"--gpu auto: no CUDA device visible ({hardware.probe_cuda().source}); "
                           "name the GPU or give --bandwidth-gbps")
    estimate = roofline.estimate_from_path(
        args.path,
        quantization=args.quantization,
        gpu=gpu,
        bandwidth_gbps=args.bandwidth_gbps,
        context_tokens=args.context,
        kv_cache_dtype=args.kv_cache_dtype,
        batch=args.batch,
    )
    payload = estimate.as_dict()
    emit(args, payload, [(key, _plain(value)) for key, value in payload.items()])
    crowded = roofline.weights_overflow(estimate)
    if crowded:
        print(f"fp8gate: warning: {crowded}", file=sys.stderr)
    return 0


def _plain(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _add_check(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "check",
        help="Check a thresholds file without starting an engine",
        description="Run every check of a thresholds file that needs no engine: the loader's (keys, values, "
        "local paths, the installed vLLM's names), key variables, task names against lm-eval's task index, "
        "the GPU a name means and each model's roofline. One line per problem; exit status 1 on any.",
    )
    parser.add_argument("thresholds", type=Path, metavar="THRESHOLDS", help="The thresholds file")
    _output_options(parser)
    parser.set_defaults(run=_run_check)


def _run_check(args: argparse.Namespace) -> int:
    from .check import check_thresholds

    started = time.perf_counter()
    findings = check_thresholds(args.thresholds)
    if args.json:
        emit(args, findings.as_dict(), ())
    else:
        for note in findings.notes:
            print(f"note: {note}")
        for problem in findings.problems:
            print(f"error: {problem}")
        count = len(findings.problems)
        verdict = f"{count} problem{'s' * (count != 1)}" if count else "no problem found"
        print(f"{args.thresholds}: {verdict}, no engine started ({time.perf_counter() - started:.1f} s)")
    return EXIT_FAILURE if findings.problems else 0


def _add_init(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "init",
        help="Write a commented thresholds file to start from",
        description="Write a thresholds file for MODEL that the loader reads as written: the baseline, the "
        "candidates (default: vLLM's online fp8_per_channel of the same weights), the noise passes for the "
        "device, probability limits as factors over the model's own Q8_0 round trip, GSM8K, and on a GPU the "
        "speed table with each model's roofline as comments where its config is on this machine.",
    )
    parser.add_argument("model", metavar="MODEL", help="The BF16 baseline: a Hugging Face id or a checkpoint directory")
    parser.add_argument("--candidate", action="append", default=[], metavar="NAME",
                        help="A vLLM quantization name (fp8_per_channel, fp8_per_tensor, ...) or a pre-quantized "
                             "checkpoint; repeat for more")
    parser.add_argument("--gpu", default="auto", help='speed.gpu: a GPU name, e.g. "H100 SXM" (default: %(default)s)')
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--output", "-o", type=Path, default=Path("thresholds.toml"),
                        help="The file to write; never overwritten (default: %(default)s)")
    parser.set_defaults(run=_run_init)


def _run_init(args: argparse.Namespace) -> int:
    from .starter import write_thresholds

    print(write_thresholds(args.output, args.model, args.candidate, args.gpu, args.device))
    return 0


def _add_demo(subparsers: Any) -> None:
    from .demo.run import add_demo_command

    add_demo_command(subparsers)


def _add_assets(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "assets",
        help="Where the embedded model, task and corpus are",
        description="Print the paths of the embedded tiny model, its lm-eval task directory "
        "(an include_path), the task name and the corpus shipped with the package.",
    )
    _output_options(parser)
    parser.set_defaults(run=_run_assets)


def _run_assets(args: argparse.Namespace) -> int:
    from .demo.embedded import embedded_assets

    payload = embedded_assets().as_dict()
    emit(args, payload, payload.items())
    return 0


def _add_plant(subparsers: Any) -> None:
    from .demo.planting import PLANT_KINDS

    parser = subparsers.add_parser(
        "plant",
        help="Write a planted FP8 regression of the embedded model",
        description="Write the embedded model with its linear weights passed through a "
        "broken FP8 round trip, as a BF16 checkpoint; an up-to-date OUT_DIR is reused.",
        epilog="kinds: " + "; ".join(f"{kind}: {text}" for kind, text in PLANT_KINDS.items()),
    )
    parser.add_argument("kind", metavar="KIND", help=f"One of: {', '.join(PLANT_KINDS)}")
    parser.add_argument("out_dir", metavar="OUT_DIR", type=Path, help="Checkpoint directory to write")
    parser.set_defaults(run=_run_plant)


def _run_plant(args: argparse.Namespace) -> int:
    from .demo.embedded import embedded_assets
    from .demo.planting import plant

    return _print_written(lambda: plant(args.kind, embedded_assets().model, args.out_dir))


def _print_written(write: Callable[[], Path]) -> int:
    """Write a checkpoint and print its directory; a refusal (a wrong kind, no weights, a path it must not
    replace) is one error line."""
    try:
        path = write()
    except (ValueError, OSError) as err:
        raise CommandError(str(err)) from err
    print(path.resolve())
    return 0


def _add_build(subparsers: Any) -> None:
    from ..run.reference_builds import BUILDS

    parser = subparsers.add_parser(
        "build",
        help="Write a reference build or the BF16 control of a checkpoint",
        description="Round every weight matrix of MODEL (a checkpoint directory, or a Hugging Face id in the "
        "local cache) as KIND says and write it as a BF16 checkpoint, to gate as a candidate: q8_0 "
        "(llama.cpp's Q8_0 round trip), e4m3 (an ideal per-channel E4M3 round trip of the linear layers), "
        "bf16-rerounded (the equally valid BF16 control, which must pass every rule). An up-to-date OUT_DIR "
        "is reused.",
    )
    parser.add_argument("kind", metavar="KIND", choices=list(BUILDS), help=f"One of: {', '.join(BUILDS)}")
    parser.add_argument("model", metavar="MODEL", help="The baseline's checkpoint directory or model id")
    parser.add_argument("out_dir", metavar="OUT_DIR", type=Path, help="Checkpoint directory to write")
    parser.set_defaults(run=_run_build)


def _run_build(args: argparse.Namespace) -> int:
    from ..checkpoint import weights_dir
    from ..run.reference_builds import write_build

    return _print_written(lambda: write_build(args.kind, weights_dir(args.model), args.out_dir))


def _add_quantize(subparsers: Any) -> None:
    from .fp8_writer import SCHEMES

    parser = subparsers.add_parser(
        "quantize",
        help="Write a pre-quantized FP8 checkpoint (compressed-tensors) from a BF16 one",
        description="Quantize every decoder linear layer of SOURCE to E4M3 in the compressed-tensors "
        "layout vLLM loads without --quantization; embeddings, lm_head and norms stay as they are. "
        "OUT_DIR must not exist.",
        epilog="schemes: " + "; ".join(f"{name}: {scheme.description}" for name, scheme in SCHEMES.items()),
    )
    parser.add_argument("source", type=Path, help="BF16 checkpoint directory")
    parser.add_argument("out_dir", metavar="OUT_DIR", type=Path, help="New checkpoint directory")
    parser.add_argument("--scheme", choices=sorted(SCHEMES), default="fp8-dynamic")
    parser.add_argument("--calibration", type=Path, default=None,
                        help="Text for fp8-static's activation scales (default: the embedded corpus)")
    parser.add_argument("--device", default="cpu", help="torch device for the arithmetic, e.g. cuda")
    parser.set_defaults(run=_run_quantize)


def _run_quantize(args: argparse.Namespace) -> int:
    from .demo.embedded import embedded_assets
    from .fp8_writer import calibration_pieces, write_fp8_checkpoint

    pieces = calibration_pieces((args.calibration or embedded_assets().corpus).read_text(encoding="utf-8"))
    path = write_fp8_checkpoint(args.source, args.out_dir, args.scheme, calibration=pieces, device=args.device)
    print(path)
    return 0


def _add_random_checkpoint(subparsers: Any) -> None:
    from .shapes import SHAPES

    parser = subparsers.add_parser(
        "random-checkpoint",
        help="Write a real model shape with random BF16 weights (no download)",
        description="Write a checkpoint of a real model's shape with random BF16 weights and the embedded "
        "tokenizer: real speed, memory, vocabulary and engine paths, meaningless answers. OUT_DIR must not exist.",
    )
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out_dir", metavar="OUT_DIR", type=Path, help="New checkpoint directory")
    parser.add_argument("--device", default="cpu", help="torch device that draws the weights, e.g. cuda")
    parser.set_defaults(run=_run_random_checkpoint)


def _run_random_checkpoint(args: argparse.Namespace) -> int:
    from .shapes import write_random_checkpoint

    try:
        print(write_random_checkpoint(args.shape, args.out_dir, device=args.device))
    except FileExistsError as err:
        raise CommandError(str(err)) from err
    return 0


_COMMANDS: list[Callable[[Any], None]] = [
    _add_compare_logprobs,
    _add_flips,
    _add_roofline,
    _add_check,
    _add_init,
    _add_demo,
    _add_assets,
    _add_plant,
    _add_build,
    _add_quantize,
    _add_random_checkpoint,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fp8gate", description="Gate a quantized LLM build against its BF16 original."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in _COMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        status: int = args.run(args)
        sys.stdout.flush()  # here, so that a reader gone early (| head) is caught below, not at exit
        return status
    except BrokenPipeError:
        # Python's documented remedy: point stdout at devnull, so the exit's own flush cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILURE
    except Fp8GateError as err:
        message, status = str(err), EXIT_ERROR if err.usage_error else EXIT_FAILURE
    except OSError as err:
        message = f"{err.filename}: {err.strerror}" if err.filename else str(err)
        status = EXIT_ERROR
    print(f"fp8gate: error: {message}", file=sys.stderr)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
