"""The `einpage generate` subcommand: plan a generation under a budget, simulate it, run it.

    einpage generate MODEL|--checkpoint DIR --budget 8GiB [--batch B] [--prompt-len P]
                     [--new-tokens N] [--prompt TEXT] [--sample --temperature T --top-k K]
                     [--seed S] [--way unrolled|steps] [--page-size 64] [--run --backend B]
                     [--render plan.svg] [--memory-map map.png]

MODEL is a model preset, `family:size` (`llama:7b`, `gpt2:tiny`, ...: `einpage presets`);
`--checkpoint` a folder as `save_pretrained` writes it (its weights, and its
`tokenizer.json` for `--prompt` text). It plans the prefill and decode steps
(`einpage.generation_plans`), prints each plan's stats and the simulated tokens/s on the
cost model, and with `--run` executes the plan and prints the tokens (the text, with a
tokenizer). A preset has no weights: `--run` then draws random ones (`--seed`), which
shows the mechanics, not meaningful text. Without `--prompt` the prompt is random ids of
`--prompt-len` tokens.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from einpage.cli_outputs import GENERATE_OUTPUTS, PicturesFailedError, check_outputs, plan_pictures
from einpage.console import Console, format_table
from einpage.generate import Generation, generate, program_weights, resolve_model
from einpage.generation_plans import WAYS
from einpage.models import FAMILIES
from einpage.models.base import ModelConfig
from einpage.models.decode import Sampling
from einpage.models.errors import GenerationError
from einpage.models.generation import DEFAULT_PAGE_SIZE
from einpage.text import decode, encode, find_tokenizer, load_tokenizer
from einpage_core.units import format_bytes
from memgraph import COST_MODELS

__all__ = ["add_generate", "cmd_generate", "random_weights"]

DEFAULT_PROMPT_LEN = 16
"""Random prompt ids when neither --prompt nor --prompt-len is given."""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def add_generate(commands: Any, common: argparse.ArgumentParser) -> None:
    """Register the `generate` subcommand on the CLI's subparsers."""
    gen = commands.add_parser(
        "generate",
        parents=[common],
        help="plan token generation (prefill + decode steps, paged KV cache) under BUDGET",
        description=__doc__.split("\n\n", 2)[2].replace("\n", " "),
    )
    gen.add_argument("model", nargs="?", metavar="MODEL", help="a model preset (llama:7b, ...)")
    gen.add_argument("--checkpoint", metavar="DIR", help="a save_pretrained folder instead")
    gen.add_argument(
        "--budget",
        "-b",
        required=True,
        help="device memory: 8GiB, 512MiB, 50%% (of the resident peak: 100%% moves nothing), "
        "150%%streaming (of the streaming minimum)",
    )
    gen.add_argument("--batch", type=_positive_int, help="sequences (default 1)")
    gen.add_argument("--prompt-len", type=_positive_int, help="random prompt ids of this length")
    gen.add_argument("--new-tokens", type=_positive_int, default=16, help="tokens to generate")
    gen.add_argument("--prompt", metavar="TEXT", help="the prompt as text (needs a tokenizer)")
    gen.add_argument(
        "--tokenizer", metavar="FILE", help="a tokenizer.json (default: the checkpoint's)"
    )
    gen.add_argument("--sample", action="store_true", help="sample instead of greedy argmax")
    gen.add_argument("--temperature", type=float, default=1.0, help="with --sample")
    gen.add_argument("--top-k", type=_positive_int, help="with --sample: keep the k largest")
    gen.add_argument("--seed", type=int, default=0, help="sampling noise, random prompt/weights")
    gen.add_argument("--way", choices=WAYS, default="unrolled", help="one plan, or step plans")
    gen.add_argument("--page-size", type=_positive_int, default=DEFAULT_PAGE_SIZE, help="KV page")
    gen.add_argument("--bucket-pages", type=_positive_int, default=1, help="pages per step bucket")
    gen.add_argument("--chunk-steps", type=_positive_int, default=1, help="steps per step plan")
    gen.add_argument("--dtype", default="float32", help="float16, float32 or float64")
    gen.add_argument(
        "--cost-model",
        choices=list(COST_MODELS),
        default="h100-pcie5",
        help="the machine's cost model (FLOP rate, bandwidths): prefetching and tokens/s",
    )
    gen.add_argument("--run", action="store_true", help="execute the plan and print the tokens")
    gen.add_argument("--backend", choices=("auto", "numpy", "cupy"), default="auto")
    gen.add_argument("--mode", choices=("sequential", "streams", "random"), help="run order")
    gen.add_argument("--render", metavar="FILE", help="draw the (largest) plan, collapsed")
    gen.add_argument("--memory-map", metavar="FILE", help="draw its memory map (.png, .svg)")
    gen.set_defaults(handler=cmd_generate)


def _model(args: argparse.Namespace) -> Any:
    """The config (a preset) or checkpoint path the arguments name."""
    if args.model is None and args.checkpoint is None:
        raise GenerationError(
            "give a MODEL preset (family:size, as llama:tiny) or --checkpoint DIR"
        )
    if args.model is not None and args.checkpoint is not None:
        raise GenerationError("give a MODEL preset (family:size) or --checkpoint DIR, not both")
    if args.checkpoint is not None:
        return Path(args.checkpoint)
    family, _, size = args.model.partition(":")
    presets = FAMILIES[family].presets if family in FAMILIES else {}
    if size not in presets:
        names = [f"{f}:{s}" for f, fam in FAMILIES.items() for s in fam.presets]
        raise GenerationError(f"unknown model {args.model!r}; presets: {', '.join(names)}")
    return presets[size]


def random_weights(cfg: ModelConfig, dtype: str, seed: int) -> dict[str, np.ndarray]:
    """Weights for a preset that has none: N(0, 0.02²), norm scales 1 (biases 0)."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in cfg.weight_shapes().items():
        if name.endswith("norm"):
            weights[name] = np.ones(shape, dtype)
        elif name.endswith("norm_bias"):
            weights[name] = np.zeros(shape, dtype)
        else:
            weights[name] = (0.02 * rng.standard_normal(shape)).astype(dtype)
    return weights


def _prompt(args: argparse.Namespace, checkpoint: Path | None, vocab: int) -> tuple[Any, Any]:
    """(prompt ids or text, tokenizer or None)."""
    batch = args.batch or 1
    if args.prompt is None:
        length = args.prompt_len or DEFAULT_PROMPT_LEN
        return np.random.default_rng(args.seed).integers(0, vocab, (batch, length)), None
    source = args.tokenizer or (checkpoint and find_tokenizer(checkpoint))
    if not source:
        raise GenerationError("--prompt needs a tokenizer: --tokenizer FILE or a checkpoint")
    tokenizer = load_tokenizer(source)
    ids = encode(tokenizer, args.prompt, batch)
    if args.prompt_len is not None and ids.shape[1] != args.prompt_len:
        raise GenerationError(
            f"--prompt encodes to {ids.shape[1]} tokens but --prompt-len is {args.prompt_len}"
        )
    return ids, tokenizer


def cmd_generate(args: argparse.Namespace, console: Console) -> int:
    """Plan (and with --run, run) the generation; print the stats and the tokens. Output
    paths are checked before any work and written whole; a picture that fails leaves the
    other and the run, and the exit code says so (`PicturesFailedError`)."""
    check_outputs(args, *GENERATE_OUTPUTS)
    model = _model(args)
    family, cfg, checkpoint = resolve_model(model)
    sampling = Sampling(args.temperature, args.top_k) if args.sample else None
    with console.stages(2 + bool(args.run) + bool(args.render) + bool(args.memory_map)):
        with console.stage("preparing the prompt"):
            prompt, tokenizer = _prompt(args, checkpoint, cfg.vocab_size)
        with console.stage("planning"):
            planned = generate(
                model,
                prompt=prompt,
                new_tokens=args.new_tokens,
                budget=args.budget,
                way=args.way,
                sampling=sampling,
                dtype=args.dtype,
                page_size=args.page_size,
                bucket_pages=args.bucket_pages,
                chunk_steps=args.chunk_steps,
                cost_model=args.cost_model,
                run=False,
                progress=console.report,
            )
        _print_plans(planned, console)
        failed = plan_pictures(args, _largest(planned), console)
        if args.run:
            with console.stage("running"):
                dtype = planned.spec.dtype
                weights = None if checkpoint else random_weights(cfg, dtype, args.seed)
                values = program_weights(cfg, weights, dtype, checkpoint)
                ran = planned.plan.run(
                    values, prompt, seed=args.seed, backend=args.backend, mode=args.mode
                )
            ids = np.concatenate([np.asarray(prompt), ran.ids], axis=1)
            _print_tokens(ids, ran.reports, tokenizer, console, checkpoint is None)
    if failed:
        raise PicturesFailedError(failed)
    return 0


def _print_plans(out: Generation, console: Console) -> None:
    spec = out.spec
    how = "greedy" if spec.sampling is None else (
        f"sampled (temperature {spec.sampling.temperature}, top-k {spec.sampling.top_k})"
    )  # fmt: skip
    rows = [
        ("model", f"{spec.cfg.name} ({spec.family.name}), {spec.dtype}"),
        (
            "generation",
            f"batch {spec.batch}, prompt {spec.prompt_len}, {spec.new_tokens} new tokens, "
            f"{how}, KV pages of {spec.page_size}",
        ),
        *out.stats.rows(),
    ]
    console.print(format_table(rows, f"generation ({out.plan.way})"))
    for name, compiled in out.plan.plans.items():
        console.print()
        console.print(format_table(compiled.rows(), f"{name} plan"))


def _largest(out: Generation) -> Any:
    return max((c.plan for c in out.plan.plans.values()), key=len)


def _print_tokens(
    ids: np.ndarray, reports: Any, tokenizer: Any, console: Console, random: bool
) -> None:
    report = reports[-1] if reports else None
    where = f"{report.backend} ({report.mode} mode)" if report is not None else "?"
    rows = [("backend", where), ("weights", "random (a preset)" if random else "checkpoint")]
    if report is not None and report.memory.get("device_peak_bytes") is not None:
        rows.append(("device memory", format_bytes(report.memory["device_peak_bytes"])))
    console.print()
    console.print(format_table(rows, "run"))
    texts = decode(tokenizer, ids) if tokenizer is not None else None
    lines = [(f"{i}", texts[i] if texts else " ".join(map(str, row))) for i, row in enumerate(ids)]
    console.print()
    console.print(format_table(lines, "tokens (prompt, then new)" if not texts else "text"))
