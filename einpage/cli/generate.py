"""The `einpage generate` subcommand: plan a generation under a budget, simulate it, run it.

    einpage generate MODEL|--checkpoint DIR|--gguf FILE --budget 8GiB [--batch B] [--prompt-len P]
                     [--new-tokens N] [--prompt TEXT ...] [--sample] [--temperature T]
                     [--top-k K] [--seed S] [--way unrolled|steps] [--page-size 64]
                     [--run --backend B] [--dtype D] [--quant int8|int4] [--devices N [--ray]]
                     [--chat | --messages FILE.json] [--stop TEXT] [--ignore-eos]
                     [--host-budget SIZE] [--spill DIR [--direct-io]]
                     [-o plan.json] [--render plan.svg] [--memory-map map.png]

MODEL is a model preset, `family:size` (`llama:7b`, `gpt2:tiny`, ...: `einpage presets`);
`--checkpoint` a folder as `save_pretrained` writes it (its weights, and its
`tokenizer.json` for `--prompt` text); `--gguf` a GGUF file (llama.cpp's: config, weights
and tokenizer in one file, planned in the file's float dtype unless `--dtype` says,
`einpage.models.gguf`). It plans the prefill and decode steps
(`einpage.workloads.generation`), prints each plan's stats and the simulated tokens/s on the
cost model, and with `--run` executes the plan and prints its measured time and the
tokens, ` | ` where the prompt ends (the text, with a tokenizer). `-o plan.json` writes
the plan for `einpage run` and `einpage stats`; step plans one file each, beside it:
`plan.prefill.json`, `plan.decode-pagesP[-stepsS].json`. A preset has no weights:
`--run` then draws random ones (`--seed`), which shows the mechanics, not meaningful
text. Without `--prompt` the prompt is random ids of `--prompt-len` tokens; several
`--prompt` are one batch, left padded to the longest. A checkpoint runs in its own dtype
unless `--dtype` says otherwise; `--quant` stores its weights in int8 or int4; `--chat`
writes each prompt (the user's message) with its chat template, `--messages` a whole
chat; each sequence stops at its end-of-sequence ids (not with `--ignore-eos`) or a
`--stop` string. `--devices N` places the generation on N devices (`--strategy`: a
pipeline, tensor parallel, or auto; `einpage.compile_devices`, the unrolled program or,
with `--way steps`, the prefill and each decode program; `--budget` is each device's,
read against its own graph, or one per device comma-separated), prints each device's
plan, and with `--run` runs every device in this process, or each in a Ray actor with
`--ray`; `-o` writes each plan's file for several devices (`einpage run FILE --check [--ray]`).
`--host-budget SIZE` plans host memory too (`memgraph.tiers`; one device, the unrolled
way): a `--checkpoint`'s weights are read where they are in its safetensors files when
the plan needs them (LLaMA, Qwen2, Mistral: GPT-2's fused attention weights and a GGUF
file are not read in place), and what does not fit is written to a spill file in
`--spill DIR` during the run.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from einpage.cli.console import Console, format_table
from einpage.cli.devices import format_columns, parse_budgets
from einpage.cli.files import atomic_output
from einpage.cli.outputs import (
    GENERATE_OUTPUTS,
    PicturesFailedError,
    check_outputs,
    plan_pictures,
    wrote,
)
from einpage.errors import EinpageError
from einpage.models import FAMILIES
from einpage.models.base import ModelConfig
from einpage.models.decode import Sampling
from einpage.models.errors import GenerationError
from einpage.models.generation import DEFAULT_PAGE_SIZE, QUANT_NAMES
from einpage.models.gguf import is_gguf
from einpage.pipeline import AUTO, CompiledDevices, device_rows
from einpage.program.quantize import Quantization
from einpage.workloads.chat import ChatTemplate, chat_rows
from einpage.workloads.generate import (
    Generation,
    Running,
    check_run_memory,
    checkpoint_tokenizer,
    choose_dtype,
    generate,
    reads_in_place,
    resolve_model,
    run_weights,
    unpadded,
)
from einpage.workloads.generation import (
    ON_DEVICES,
    WAYS,
    DevicesPlan,
    DevicesStepPlans,
    Planning,
    StepPlans,
    UnrolledPlan,
    decode_name,
)
from einpage.workloads.stop import Stopped, checkpoint_stopping, kept_stats, run_stopping
from einpage.workloads.text import (
    decode,
    encode_rows,
    load_tokenizer,
    missing_tokenizer,
    padded,
)
from einpage_core.errors import InputError
from einpage_core.units import format_bytes
from memgraph import COST_MODELS
from memgraph.peer import SENDS
from memgraph.placement import STRATEGIES
from taskgraph import dtypes

__all__ = ["add_generate", "cmd_generate", "random_weights", "plan_files"]

OUTPUTS = (("output", "JSON file", "-o"), *GENERATE_OUTPUTS)
"""`einpage generate`'s outputs: (attribute, kind, option), checked before any work."""

DEFAULT_PROMPT_LEN = 16
"""Random prompt ids when neither --prompt nor --prompt-len is given."""


def positive_int(text: str) -> int:
    """An argparse type: an integer > 0 (the command line's counts and sizes)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _seed(text: str) -> int:
    """A seed for NumPy's generators: an integer >= 0 (a negative one made NumPy raise a
    traceback when the random prompt was drawn)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _dtype(text: str) -> str:
    """An argparse type: a float dtype einpage plans in (`taskgraph.dtypes.FLOAT_DTYPES`,
    or a short name such as bf16), canonical."""
    try:
        name = dtypes.canonical(text)
    except EinpageError:
        name = None
    if name is None or not dtypes.is_float(name):
        raise argparse.ArgumentTypeError(
            f"expected one of {', '.join(dtypes.FLOAT_DTYPES)}, got {text!r}"
        )
    return name


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
        "--gguf", metavar="FILE", help="a GGUF file instead (llama, qwen2, mistral; its tokenizer)"
    )
    gen.add_argument(
        "--budget",
        "-b",
        required=True,
        help="device memory: 8GiB, 512MiB, 50%% (of the resident peak: 100%% moves nothing), "
        "150%%streaming (of the streaming minimum)",
    )
    gen.add_argument("--batch", type=positive_int, help="sequences (default 1)")
    gen.add_argument("--prompt-len", type=positive_int, help="random prompt ids of this length")
    gen.add_argument("--new-tokens", type=positive_int, default=16, help="tokens to generate")
    gen.add_argument(
        "--prompt",
        metavar="TEXT",
        action="append",
        help="the prompt as text (needs a tokenizer); several --prompt make a batch of "
        "different prompts, left padded to the longest (no --batch needed; with --chat, "
        "each is the user's message of its own chat)",
    )
    gen.add_argument(
        "--tokenizer", metavar="FILE", help="a tokenizer.json (default: the checkpoint's)"
    )
    gen.add_argument(
        "--chat",
        action="store_true",
        help="write the prompt as the checkpoint's chat template does: --prompt is the "
        "user's message (or give --messages)",
    )
    gen.add_argument(
        "--messages",
        metavar="FILE.json",
        help='a chat\'s messages, [{"role": "user", "content": "..."}, ...], written '
        "as the checkpoint's chat template does (implies --chat)",
    )
    gen.add_argument(
        "--sample",
        action="store_true",
        help="sample the next token instead of the greedy argmax (implied by --temperature "
        "and --top-k)",
    )
    gen.add_argument(
        "--temperature",
        type=float,
        metavar="T",
        help="sample from softmax(logits / T), T > 0: below 1 sharper, above 1 flatter "
        "(default 1.0 when sampling); implies --sample",
    )
    gen.add_argument(
        "--top-k",
        type=positive_int,
        metavar="K",
        help="sample among the K largest logits only (default: all); implies --sample",
    )
    gen.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="end a sequence where its text reaches TEXT (needs a tokenizer; repeatable); "
        "the text printed ends before it",
    )
    gen.add_argument(
        "--ignore-eos",
        action="store_true",
        help="do not stop at the checkpoint's end-of-sequence ids (eos_token_id of its "
        "generation_config.json or config.json): make every --new-tokens",
    )
    gen.add_argument("--seed", type=_seed, default=0, help="sampling noise, random prompt/weights")
    gen.add_argument("--way", choices=WAYS, default="unrolled", help="one plan, or step plans")
    gen.add_argument("--page-size", type=positive_int, default=DEFAULT_PAGE_SIZE, help="KV page")
    gen.add_argument("--bucket-pages", type=positive_int, default=1, help="pages per step bucket")
    gen.add_argument("--chunk-steps", type=positive_int, default=1, help="steps per step plan")
    gen.add_argument(
        "--dtype",
        type=_dtype,
        help=f"the weights' and activations' type: {', '.join(dtypes.FLOAT_DTYPES)} (default: "
        "the checkpoint's own, as its config.json or GGUF file names it; float32 for a preset)",
    )
    gen.add_argument(
        "--quant",
        choices=tuple(QUANT_NAMES),
        help="store the matmul weights in int8 or int4 (group-wise scales), rebuilt on the "
        "device at each step: only the quantized bytes stay on the host and cross PCIe",
    )
    gen.add_argument(
        "--cost-model",
        choices=list(COST_MODELS),
        default="h100-pcie5",
        help="the machine's cost model (FLOP rate, bandwidths): prefetching and tokens/s",
    )
    gen.add_argument(
        "--devices",
        type=positive_int,
        default=1,
        metavar="N",
        help="place the generation (unrolled, or each step plan with --way steps) on N "
        "devices (--strategy), each planned under --budget read "
        "against its own graph (or one budget per device, comma-separated)",
    )
    gen.add_argument(
        "--strategy",
        choices=[*STRATEGIES, AUTO],
        default="pipeline",
        help="how --devices shares the work: pipeline (consecutive layers per device), "
        "tensor (each device its share of every layer's heads and MLP columns), auto "
        "(unrolled only: each planned, the fastest on --cost-model kept)",
    )
    gen.add_argument(
        "--sends",
        choices=list(SENDS),
        default="host",
        help="how --devices sends tensors between devices: host (staged through host "
        "memory) or direct (device to device wherever that cannot deadlock)",
    )
    gen.add_argument(
        "--ray",
        action="store_true",
        help="with --devices N and --run: run each device in a Ray actor of a local Ray "
        "instance (pip install 'einpage[cluster]'), not a thread of this process",
    )
    gen.add_argument(
        "--host-budget",
        metavar="SIZE",
        help="plan host memory too, within SIZE (16GiB, or a percentage of what the host "
        "would hold): a --checkpoint's weights read where they are in its safetensors when "
        "needed, what does not fit spilled to --spill DIR (one device, --way unrolled)",
    )
    gen.add_argument(
        "--spill",
        metavar="DIR",
        help="the folder a run writes its spill file in (created at the start, removed at "
        "once: nothing is left), for what does not fit --host-budget",
    )
    gen.add_argument(
        "--direct-io",
        action="store_true",
        help="with --host-budget/--spill and --run: read and write the disk files with "
        "O_DIRECT where the file system allows, keeping the page cache out of the run's "
        "memory (default: through the page cache)",
    )
    gen.add_argument("--run", action="store_true", help="execute the plan and print the tokens")
    gen.add_argument("--backend", choices=("auto", "numpy", "cupy"), default="auto")
    gen.add_argument("--mode", choices=("sequential", "streams", "random"), help="run order")
    gen.add_argument(
        "-o",
        "--output",
        metavar="FILE.json",
        help="write the plan for einpage run/stats; step plans: one file per plan beside "
        "it, FILE.prefill.json and FILE.decode-pagesP[-stepsS].json",
    )
    gen.add_argument("--render", metavar="FILE", help="draw the (largest) plan, collapsed")
    gen.add_argument("--memory-map", metavar="FILE", help="draw its memory map (.png, .svg)")
    gen.set_defaults(handler=cmd_generate)


def _model(args: argparse.Namespace) -> Any:
    """The config (a preset) or checkpoint path (a folder or a GGUF file) the arguments
    name."""
    given = [f"MODEL {args.model!r}"] if args.model is not None else []
    given += [f"--checkpoint {args.checkpoint!r}"] if args.checkpoint is not None else []
    given += [f"--gguf {args.gguf!r}"] if args.gguf is not None else []
    if len(given) > 1:
        raise GenerationError(
            "give one of a MODEL preset, --checkpoint DIR or --gguf FILE, not both (got "
            + " and ".join(given)
            + ")"
        )
    if not given:
        raise GenerationError(
            "give the model: a MODEL preset (family:size, e.g. llama:tiny; `einpage presets` "
            "lists them), --checkpoint DIR (a save_pretrained folder) or --gguf FILE"
        )
    if args.gguf is not None:
        if not is_gguf(args.gguf):
            raise GenerationError(f"--gguf {args.gguf!r}: a GGUF file's name ends in .gguf")
        return Path(args.gguf)
    if args.checkpoint is not None:
        return Path(args.checkpoint)
    family, _, size = args.model.partition(":")
    presets = FAMILIES[family].presets if family in FAMILIES else {}
    if size not in presets:
        names = [f"{f}:{s}" for f, fam in FAMILIES.items() for s in fam.presets]
        raise GenerationError(f"unknown model {args.model!r}; presets: {', '.join(names)}")
    return presets[size]


def _sampling(args: argparse.Namespace) -> Sampling | None:
    """How tokens are chosen: greedy, unless --sample, --temperature or --top-k is given
    (either of the last two implies --sample: given alone they used to be ignored); the
    noise is drawn from --seed."""
    if not (args.sample or args.temperature is not None or args.top_k is not None):
        return None
    temperature = 1.0 if args.temperature is None else args.temperature
    return Sampling(temperature, args.top_k, args.seed)


def _planning(args: argparse.Namespace, console: Console) -> Planning:
    """How the generation is planned: --way, --bucket-pages, --chunk-steps, --cost-model,
    --devices, --strategy, --sends, and (on one device) the console's progress bars."""
    return Planning(
        way=args.way,
        bucket_pages=args.bucket_pages,
        chunk_steps=args.chunk_steps,
        cost_model=args.cost_model,
        options={"progress": console.report} if args.devices == 1 else {},
        devices=args.devices,
        strategy=args.strategy,
        sends=args.sends,
        host_budget=args.host_budget,
        spill=args.spill,
    )


def _check_devices(args: argparse.Namespace) -> None:
    """What --devices and --ray refuse before any work: --ray without devices to place
    or without --run, --host-budget or --spill on several devices or with step plans,
    --mode streams on several devices, and the pictures, which draw one device's plan
    (not built for several, as for `einpage plan --devices`)."""
    if args.ray and args.devices == 1:
        raise InputError(
            "--ray runs a generation placed on several devices: give --devices N (N > 1); "
            "one device runs in this process"
        )
    if args.ray and not args.run:
        raise InputError("--ray says where --run runs the generation: give --run too")
    tier = [f"--{n.replace('_', '-')}" for n in ("host_budget", "spill") if getattr(args, n)]
    if tier and args.devices > 1:
        raise InputError(
            f"{' and '.join(tier)} plan the host memory of one device; on --devices "
            f"{args.devices} a host tier is not built"
        )
    if args.direct_io and not (tier and args.run):
        raise InputError(
            "--direct-io says how --run moves a host tier's disk bytes: give --host-budget "
            "(or --spill) and --run too"
        )
    if tier and args.way != "unrolled":
        raise InputError(
            f"{' and '.join(tier)} plan host memory for --way unrolled (a plan with a host "
            "tier runs alone; step plans share their session: not built)"
        )
    if args.devices == 1:
        return
    if args.mode == "streams":
        raise InputError(
            f"--mode streams is not built for --devices {args.devices} (each device runs its "
            "nodes one at a time): --mode sequential or random"
        )
    for option in ("render", "memory_map"):
        if getattr(args, option, None):
            raise InputError(
                f"--{option.replace('_', '-')} draws the plan of one device; with --devices "
                f"{args.devices}, -o writes the plans (pictures of several devices are not "
                "built yet)"
            )


def random_weights(cfg: ModelConfig, dtype: str, seed: int) -> dict[str, np.ndarray]:
    """Weights for a preset that has none: N(0, 0.02²), norm scales 1 (biases 0). Each is
    drawn in float32 (float64 for float64 weights) and scaled in place, then cast: at most
    one weight's float32 copy besides the weights (`check_run_memory` counts it)."""
    rng = np.random.default_rng(seed)
    draw = np.float64 if dtypes.canonical(dtype) == "float64" else np.float32
    weights = {}
    for name, shape in cfg.weight_shapes().items():
        if name.endswith("norm"):
            weights[name] = np.ones(shape, dtype)
        elif name.endswith("norm_bias"):
            weights[name] = np.zeros(shape, dtype)
        else:
            values = rng.standard_normal(shape, dtype=draw)
            values *= 0.02
            weights[name] = values.astype(dtype, copy=False)
    return weights


def _chat_messages(args: argparse.Namespace) -> Any:
    """The chat's messages: --messages FILE.json, or --prompt as the user's message (each
    of several --prompt its own conversation, one sequence of the batch)."""
    if args.messages is not None and args.prompt is not None:
        raise GenerationError(
            "give --prompt (the user's message) or --messages FILE.json, not both"
        )
    if args.messages is None:
        if args.prompt is None:
            raise GenerationError(
                "--chat needs the user's message as --prompt TEXT, or --messages FILE.json"
            )
        chats = [[{"role": "user", "content": text}] for text in args.prompt]
        return chats[0] if len(chats) == 1 else chats
    try:
        return json.loads(Path(args.messages).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as err:
        raise GenerationError(f"--messages: cannot read {args.messages!r}: {err}") from None
    except json.JSONDecodeError as err:
        raise GenerationError(
            f"--messages: {args.messages!r} is not valid JSON: {err.msg} at line {err.lineno} "
            f"column {err.colno}"
        ) from None


def _prompt(args: argparse.Namespace, checkpoint: Path | None, vocab: int) -> tuple[Any, Any]:
    """(prompt ids [batch, prompt_len] – or, for several --prompt (or chats) of
    different lengths, one id list per prompt, which `generate` pads –, tokenizer or
    None)."""
    batch = args.batch or 1
    if args.chat or args.messages is not None:
        messages = _chat_messages(args)
        source = args.tokenizer or (checkpoint and checkpoint_tokenizer(checkpoint))
        if not source:
            raise GenerationError(f"--chat: {missing_tokenizer(checkpoint, '--tokenizer FILE')}")
        template = ChatTemplate.of_checkpoint(checkpoint or source)
        tokenizer = load_tokenizer(source) if isinstance(source, str | os.PathLike) else source
        rows, _ = chat_rows(template, tokenizer, messages, args.batch)
        return _rows_or_ids(rows), tokenizer
    if args.prompt is None:
        length = args.prompt_len or DEFAULT_PROMPT_LEN
        return np.random.default_rng(args.seed).integers(0, vocab, (batch, length)), None
    source = args.tokenizer or (checkpoint and checkpoint_tokenizer(checkpoint))
    if not source:
        raise GenerationError(f"--prompt: {missing_tokenizer(checkpoint, '--tokenizer FILE')}")
    tokenizer = load_tokenizer(source) if isinstance(source, str | os.PathLike) else source
    texts = args.prompt
    if len(texts) > 1 and args.batch is not None and args.batch != len(texts):
        raise GenerationError(
            f"--batch {args.batch} but {len(texts)} prompts are given (several --prompt make "
            "the batch: leave --batch out)"
        )
    rows = encode_rows(tokenizer, texts)
    if len({len(row) for row in rows}) > 1:
        if args.prompt_len is not None:
            raise GenerationError("--prompt-len is for one prompt length: leave it out")
        return _rows_or_ids(rows), tokenizer
    ids = np.array(rows) if len(rows) > 1 else np.repeat(np.array(rows), batch, axis=0)
    if args.prompt_len is not None and ids.shape[1] != args.prompt_len:
        raise GenerationError(
            f"--prompt encodes to {ids.shape[1]} tokens but --prompt-len is {args.prompt_len}"
        )
    return ids, tokenizer


def _rows_or_ids(rows: list[list[int]]) -> Any:
    """Prompt rows as `generate` takes them: ids [batch, prompt_len] when they are as
    long, else the lists (a ragged batch, which `generate` left pads)."""
    return np.array(rows, dtype=np.int64) if len({len(r) for r in rows}) == 1 else rows


def cmd_generate(args: argparse.Namespace, console: Console) -> int:
    """Plan (and with --run, run) the generation; print the stats and the tokens. Output
    paths are checked before any work and written whole; a picture that fails leaves the
    other and the run, and the exit code says so (`PicturesFailedError`)."""
    check_outputs(args, *OUTPUTS)
    _check_devices(args)
    model = _model(args)
    family, cfg, checkpoint = resolve_model(model)
    dtype, why = choose_dtype(args.dtype, checkpoint)
    stopping = checkpoint_stopping(checkpoint, () if args.ignore_eos else None, args.stop)
    sampling = _sampling(args)
    planning = _planning(args, console)
    running = Running(args.backend, args.mode, "ray" if args.ray else "local", args.direct_io)
    budget = parse_budgets(args.budget) if args.devices > 1 else args.budget
    with console.stages(2 + bool(args.run) + bool(args.render) + bool(args.memory_map)):
        with console.stage("preparing the prompt"):
            prompt, tokenizer = _prompt(args, checkpoint, cfg.vocab_size)
            if stopping.strings and tokenizer is None:
                raise GenerationError(
                    "--stop: stop strings need a text prompt (--prompt, --chat or "
                    "--messages) and a tokenizer"
                )
        with console.stage("planning"):
            planned = generate(
                model,
                prompt,
                args.new_tokens,
                budget,
                dtype=dtype,
                page_size=args.page_size,
                sampling=sampling,
                plan=planning,
                quant=args.quant,
                run=None,  # run below: the host memory is checked before weights are drawn
            )
        _print_plans(planned, why, console)
        if args.output:
            _write_plans(planned.plan, args.output, console)
        failed = plan_pictures(args, _largest(planned), console)
        if args.run:
            with console.stage("running"):
                dtype = planned.spec.dtype
                in_place = reads_in_place(planned.plan)
                made = "read from the checkpoint" if checkpoint else "drawn at random"
                check_run_memory(planned.plan, running.backend, None if in_place else made)
                weights = None if checkpoint else random_weights(cfg, dtype, args.seed)
                values = {} if in_place else run_weights(planned.spec, weights, checkpoint)
                plan = planned.plan
                if isinstance(plan, ON_DEVICES):
                    plan = plan.on(running.runner)
                started = time.perf_counter()
                ids, _ = padded(prompt, cfg.vocab_size)  # left padded as generate did
                ran = run_stopping(
                    plan, values, ids, stopping, tokenizer, running.backend, running.mode,
                    running.direct_io,
                )  # fmt: skip
                seconds = time.perf_counter() - started
            _print_run(planned, ran, seconds, checkpoint is None, console, running)
            prompts = unpadded(ids, planned.prompt_lengths, planned.spec.prompt_len)
            _print_tokens(prompts, ran, tokenizer, console)
    if failed:
        raise PicturesFailedError(failed)
    return 0


def _print_plans(out: Generation, dtype_why: str, console: Console) -> None:
    """The generation's table (what was planned: the model and its dtype, and why that
    dtype – given, the checkpoint's own or the default –, the shapes, the budget, the
    stats), then each plan's."""
    spec = out.spec
    how = "greedy" if spec.sampling is None else (
        f"sampled (temperature {spec.sampling.temperature}, top-k {spec.sampling.top_k})"
    )  # fmt: skip
    rows = [
        (
            "model",
            f"{spec.cfg.name} ({spec.family.name}), {spec.dtype} ({dtype_why})"
            f"{_quant_note(spec)}",
        ),
        (
            "generation",
            f"batch {spec.batch}, prompt {_prompt_lengths(spec)}, {spec.new_tokens} new "
            f"tokens, {how}, KV pages of {spec.page_size}",
        ),
        ("budget", str(out.plan.budget)),
        *out.stats.rows(),
    ]
    title = f"generation ({out.plan.way})"
    if isinstance(out.plan, ON_DEVICES):
        title = f"generation ({out.plan.way}, on {out.plan.devices} devices)"
    console.print(format_table(rows, title))
    for name, compiled in out.plan.plans.items():
        console.print()
        console.print(format_table(compiled.rows(), f"{name} plan"))
    placed = {n: c for n, c in out.plan.plans.items() if isinstance(c, CompiledDevices)}
    for name, compiled in placed.items():
        console.print()
        title = "devices" if len(placed) == 1 else f"devices ({name} plan)"
        console.print(format_columns(device_rows(compiled.plan), title))


def _prompt_lengths(spec: Any) -> str:
    """The prompt length, and for a ragged batch each prompt's: "7 (lengths 3, 7; left
    padded)"."""
    if spec.lengths is None:
        return str(spec.prompt_len)
    return f"{spec.prompt_len} (lengths {', '.join(map(str, spec.lengths))}; left padded)"


def _quant_note(spec: Any) -> str:
    """What the model row adds for a quantized generation (its bits and group, or for one
    quantization per weight – a GGUF file's – how many weights have each), or nothing."""
    if spec.quant is None:
        return ""
    if isinstance(spec.quant, Quantization):
        return f", weights int{spec.quant.bits} (groups of up to {spec.quant.group})"
    labels = Counter(q.label for q in spec.quant.values())
    each = ", ".join(f"{n} {label}" for label, n in sorted(labels.items()))
    return f", quantized weights as stored ({each})"


def _largest(out: Generation) -> Any:
    """The plan with the most nodes (a MemGraph; of several devices', the largest)."""
    if isinstance(out.plan, ON_DEVICES):
        return max((p.mg for c in out.plan.plans.values() for p in c.plan.plans), key=len)
    return max((c.plan for c in out.plan.plans.values()), key=len)


def plan_files(
    plan: UnrolledPlan | StepPlans | DevicesPlan | DevicesStepPlans, path: str | Path
) -> dict[str, Path]:
    """Where `-o path` writes each plan, by plan name: the unrolled plan (on one device or
    several: one file for several devices) to `path`; step plans (on one device or
    several) one file each beside it, `{stem}.prefill.json` and
    `{stem}.decode-pages{P}[-steps{S}].json` (a bucket of P pages, chunks of S steps)."""
    path = Path(path)
    if isinstance(plan, UnrolledPlan | DevicesPlan):
        return {"unrolled": path}
    files = {"prefill": path.with_name(f"{path.stem}.prefill.json")}
    for pages, steps in sorted(plan.decoders):
        chunk = "" if steps == 1 else f"-steps{steps}"
        files[decode_name(pages, steps)] = path.with_name(
            f"{path.stem}.decode-pages{pages}{chunk}.json"
        )
    return files


def _write_plans(
    plan: UnrolledPlan | StepPlans | DevicesPlan | DevicesStepPlans, path: str, console: Console
) -> None:
    """Each plan to its file (`plan_files`), written whole; a plan for several devices
    as `einpage plan --devices` writes it (`CompiledDevices.save`)."""
    for name, file in plan_files(plan, path).items():
        compiled = plan.plans[name]
        with atomic_output(file) as temporary:
            if isinstance(compiled, CompiledDevices):
                compiled.save(temporary)
            else:
                temporary.write_text(compiled.plan.to_json(), encoding="utf-8")
        what = f"{name} plan for {plan.devices} devices" if isinstance(plan, ON_DEVICES) else None
        wrote(console, what or f"{name} plan", file)


def _print_run(
    planned: Generation,
    ran: Stopped,
    seconds: float,
    random: bool,
    console: Console,
    running: Running,
) -> None:
    """The run's table: where it ran, the weights, the device memory, the tokens kept
    (when a sequence stopped), and its measured time beside the simulated one, both in
    tokens kept per second (`einpage.workloads.stop.kept_stats`). A run on several
    devices says its runner and each device's backend as asked (its runners report no
    sessions: no device memory row, no time in the plans)."""
    reports = ran.reports
    report = reports[-1] if reports else None
    where = f"{report.backend} ({report.mode} mode)" if report is not None else "?"
    if isinstance(planned.plan, ON_DEVICES):
        how = "a Ray actor" if running.runner == "ray" else "a thread of this process"
        where = (
            f"{planned.plan.devices} devices, each in {how}, backend {running.backend!r} "
            f"each ({running.mode or 'ready'} order)"
        )
    weights = "random (a preset)" if random else "checkpoint"
    if reads_in_place(planned.plan):
        weights = "checkpoint, read in place by the host tier"
    rows = [("backend", where), ("weights", weights)]
    if report is not None and report.memory.get("device_peak_bytes") is not None:
        rows.append(("device memory", format_bytes(report.memory["device_peak_bytes"])))
    if report is not None and report.disk_direct:
        direct = sum(report.disk_direct)
        how = f"O_DIRECT for {direct} of {len(report.disk_direct)} files" if direct else (
            "through the page cache"
        )  # fmt: skip
        rows.append(("disk transfers", how))
    tokens, stats = ran.tokens, kept_stats(planned.plan, planned.stats, ran)
    if tokens < planned.spec.tokens:
        kept = ", ".join(map(str, ran.new_lengths))
        rows.append(("stopped", f"{tokens} of {planned.spec.tokens} tokens kept ({kept})"))
    in_plans = sum(r.seconds for r in reports)
    measured = f"{seconds * 1e3:,.2f} ms, {tokens / seconds:,.1f} tokens/s"
    if reports:
        measured += (
            f" ({len(reports)} run{'s' * (len(reports) > 1)}: {in_plans * 1e3:,.2f} ms in "
            "the plans, the rest staging and the host loop)"
        )
    else:
        measured += " (every device, staging and gathering included)"
    rows.append(("measured", measured))
    together = f", {stats.devices} devices together" if stats.devices > 1 else ""
    rows.append(
        (
            f"simulated ({stats.cost_model}{together})",
            f"{stats.simulated_seconds * 1e3:,.2f} ms, {stats.tokens_per_s:,.1f} tokens/s",
        )
    )
    console.print()
    console.print(format_table(rows, "run"))


PROMPT_END = " | "
"""What the token lines put between the prompt and the new tokens."""


def _print_tokens(prompt: Any, ran: Stopped, tokenizer: Any, console: Console) -> None:
    """Each sequence, the prompt (without its padding) then the new tokens it kept,
    `PROMPT_END` between them: ids, or the text with a tokenizer (ending before a stop
    string)."""
    lines = []
    for i, (head, kept) in enumerate(zip(prompt, ran.new_lengths, strict=True)):
        tail = ran.new_ids[i, :kept]
        if tokenizer is None:
            line = " ".join(map(str, head)) + PROMPT_END + " ".join(map(str, tail))
        else:
            line = _marked_text(tokenizer, head, tail, ran.text[i])
        lines.append((f"{i}", line))
    console.print()
    title = "tokens" if tokenizer is None else "text"
    console.print(format_table(lines, f"{title} (prompt{PROMPT_END}new)"))


def _marked_text(tokenizer: Any, head: np.ndarray, tail: np.ndarray, whole: str) -> str:
    """The sequence's text `whole` (the run's, cut before a stop string) with
    `PROMPT_END` where the prompt's text ends: cut after the prompt's own text when that
    is its start, else the two parts decoded apart."""
    (prompt_text,) = decode(tokenizer, [head])
    if whole.startswith(prompt_text):
        return prompt_text + PROMPT_END + whole[len(prompt_text) :].lstrip(" ")
    return prompt_text + PROMPT_END + decode(tokenizer, [tail])[0]
