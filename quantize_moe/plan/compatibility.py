"""Which engines load which (format, scheme), and the choice that loads in the most of them.

Every "yes" is proven by a test that loads our output in that engine (PROVEN_BY): vLLM 0.32's CPU
build by tests/test_vllm_client.py, transformers by tests/test_clients.py; SGLang has not been run
(../shared/reference/fp8-formats.md §5 says what its sources read). A combination missing from
the table is read by no engine and refused.
"""

from __future__ import annotations

from dataclasses import replace

from quantize_moe.errors import UsageError, UserError
from quantize_moe.plan.options import ACTIVATION_CHOICES, AUTO, KV_CACHE_CHOICES, Options
from quantize_moe.quantization.formats import FORMATS
from quantize_moe.quantization.schemes import SCHEMES

ENGINES = ("vLLM", "SGLang", "transformers")
TP_SIZES = (1, 2, 4, 8, 16)

# (format, scheme) -> per engine: "yes" (a test in PROVEN_BY loads it there) or why not; listed in order of
# preference when as many engines load. The README's "Formats and schemes" table is rendered from it.
NOT_VERIFIED = "not verified"
LOADS: dict[tuple[str, str], dict[str, str]] = {
    ("fp8", "block"): {"vLLM": "yes", "SGLang": NOT_VERIFIED, "transformers": "yes"},
    ("compressed-tensors", "channel"): {"vLLM": "yes", "SGLang": NOT_VERIFIED, "transformers": "yes"},
    ("compressed-tensors", "tensor"): {"vLLM": "yes", "SGLang": NOT_VERIFIED, "transformers": "yes"},
    ("fp8", "tensor"): {"vLLM": "yes", "SGLang": NOT_VERIFIED,
                        "transformers": "no: it reads weight_scale_inv, not weight_scale"},
    ("compressed-tensors", "block"): {"vLLM": "yes", "SGLang": NOT_VERIFIED,
                                      "transformers": "no: block-scaled MoE experts fail to load"},
}
PROVEN_BY = {"vLLM": "tests/test_vllm_client.py", "transformers": "tests/test_clients.py"}
# Where one family's output loads differently from LOADS (by family name), proven by the same tests.
FAMILY_LOADS: dict[str, dict[tuple[str, str], dict[str, str]]] = {
    "Llama-4": {("fp8", "block"): {"transformers": "no: its Llama-4 experts are fused parameters, and only its "
                                                   "compressed-tensors path reads them one Linear per expert"}},
}
ON_DISK = {
    ("fp8", "block"): "`weight_scale_inv` float32 `[ceil(N/128), ceil(K/128)]`, `weight_block_size: [128, 128]`",
    ("compressed-tensors", "channel"): "`weight_scale` in the model dtype `[N, 1]`, dynamic per-token activations",
    ("compressed-tensors", "tensor"): "`weight_scale` in the model dtype `[1]`, dynamic per-tensor activations",
    ("fp8", "tensor"): "`weight_scale` float32 scalar (AutoFP8 style)",
    ("compressed-tensors", "block"): "`weight_scale` in the model dtype, 128x128 blocks, dynamic group-128 "
                                     "activations",
}


def compatibility_table() -> str:
    """The README's table of formats and schemes: what is on disk and, per engine, the test that loads
    it there or why not."""
    lines = [f"| `--format` / `--scheme` | on disk | {' | '.join(ENGINES)} |", "|---|---|" + "---|" * len(ENGINES)]
    for (fmt, scheme), verdicts in LOADS.items():
        cells = [f"yes (`{PROVEN_BY[e]}`)" if verdicts[e] == "yes" else verdicts[e] for e in ENGINES]
        lines.append(f"| `{fmt}` / `{scheme}` | {ON_DISK[(fmt, scheme)]} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


FUSED_EXPERTS = ("fp8", "tensor")  # the one combination engines load for fused 3-D expert tensors


def verdicts(fmt: str, scheme: str, family: str | None = None) -> dict[str, str]:
    """Per engine, "yes" or why not, for this combination written for `family` (a family name)."""
    return {**LOADS[(fmt, scheme)], **FAMILY_LOADS.get(family, {}).get((fmt, scheme), {})}


def loading_engines(fmt: str, scheme: str, family: str | None = None) -> list[str]:
    return [engine for engine, verdict in verdicts(fmt, scheme, family).items() if verdict == "yes"]


def _flags(fmt: str, scheme: str) -> str:
    return f"--format {fmt} --scheme {scheme}"


def resolve_options(options: Options, experts: list[tuple[str, tuple[int, ...]]],
                    fused_family: str | None = None, family: str | None = None) -> Options:
    """Options with `auto` format and scheme replaced by the combination, among those the user left
    open, that loads in the most engines for `family` and fits every routed expert (name, shape). Fused
    expert tensors (`fused_family`) are loaded by engines with native per-tensor scales only."""
    if options.scheme not in (AUTO, *SCHEMES):
        raise UsageError(f"--scheme {options.scheme} is not available; choose one of {AUTO}, "
                         f"{', '.join(SCHEMES)}.")
    if options.format not in (AUTO, *FORMATS):
        raise UsageError(f"--format {options.format} is not available; choose one of {AUTO}, "
                         f"{', '.join(FORMATS)}.")
    options = _static_scheme(options)
    ranked = _ranked(fused_family, family)
    fitting = [c for c in ranked if _expert_misfit(c[1], experts) is None]
    wanted = _wanted(options, ranked)
    if not wanted and fused_family:
        raise UserError(f"--format {options.format} --scheme {options.scheme} is not available for {fused_family}, "
                        "whose experts are fused tensors that engines load with per-tensor scales only; use "
                        f"{_flags(*FUSED_EXPERTS)}.")
    if not wanted:
        others = [c for c in fitting if options.scheme in (AUTO, c[1])] or fitting
        raise UsageError(f"--format {options.format} stores only {' or '.join(FORMATS[options.format].schemes)} "
                         f"scales, so no engine would read it with --scheme {options.scheme}; "
                         f"use {_flags(*others[0])}.")
    usable = [c for c in wanted if c in fitting]
    if not usable:
        name, why = _expert_misfit(wanted[0][1], experts)
        raise UserError(f"--scheme {wanted[0][1]} does not fit this checkpoint's routed experts: in '{name}', "
                        f"{why}; use {_flags(*fitting[0])}.")
    fmt, scheme = usable[0]
    return replace(options, format=fmt, scheme=scheme)


def _ranked(fused_family: str | None, family: str | None = None) -> list[tuple[str, str]]:
    return [FUSED_EXPERTS] if fused_family else sorted(LOADS, key=lambda c: -len(loading_engines(*c, family)))


def _wanted(options: Options, ranked: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [c for c in ranked if options.format in (AUTO, c[0]) and options.scheme in (AUTO, c[1])]


def explain_auto(requested: Options, resolved: Options, experts: list[tuple[str, tuple[int, ...]]],
                 fused_family: str | None = None, family: str | None = None) -> str | None:
    """One line saying what `auto` resolved to and why (None when the user gave format and scheme), so a
    run never leaves people guessing which combination they got."""
    if AUTO not in (requested.format, requested.scheme):
        return None
    chosen = (resolved.format, resolved.scheme)
    line = f"auto chose --format {chosen[0]} --scheme {chosen[1]}"
    if fused_family:
        return f"{line}: {fused_family} experts are fused tensors, which engines load with per-tensor scales only"
    if requested.activations == "static" and requested.scheme == AUTO:
        return f"{line}: --activations static pairs per-tensor input scales with per-tensor weight scales"
    engines = " and ".join(loading_engines(*chosen, family))
    wanted = _wanted(requested, _ranked(None, family))
    skipped = wanted[:wanted.index(chosen)]
    if skipped and (misfit := _expert_misfit(skipped[0][1], experts)):
        return (f"{line} (loads in {engines}): {skipped[0][0]} / {skipped[0][1]} does not fit the routed "
                f"experts ('{misfit[0]}': {misfit[1]})")
    return f"{line}: loads in {engines}, the most engines of the combinations left open"


def check_calibrated(options: Options) -> None:
    """The calibration options make sense together (checked before any calibration data is read)."""
    if options.activations not in ACTIVATION_CHOICES:
        raise UsageError(f"--activations {options.activations} is not available; choose one of "
                         f"{', '.join(ACTIVATION_CHOICES)}.")
    if options.kv_cache not in (None, *KV_CACHE_CHOICES):
        raise UsageError(f"--kv-cache {options.kv_cache} is not available; write --kv-cache "
                         f"{' or '.join(KV_CACHE_CHOICES)}.")
    if options.calibrates != (options.calibration is not None):
        raise UsageError("--activations static and --kv-cache fp8 need --calibration FILE, the tokens their scales are "
                         "measured on." if options.calibrates else
                         "--calibration is used by --activations static or --kv-cache fp8 only; add one or drop it.")
    # Static input scales are per tensor, and vLLM's MoE methods take them with per-tensor weights only.
    if options.activations == "static" and options.scheme not in (AUTO, "tensor"):
        raise UsageError(f"--activations static takes --scheme tensor only (static input scales are per tensor, "
                         f"and engines pair them with per-tensor weights), not --scheme {options.scheme}; use "
                         "--scheme tensor or --activations dynamic.")


def _static_scheme(options: Options) -> Options:
    """With static activations `auto` becomes tensor (channel and block are refused)."""
    check_calibrated(options)
    return replace(options, scheme="tensor") if options.activations == "static" else options


def _expert_misfit(scheme: str, experts: list[tuple[str, tuple[int, ...]]]) -> tuple[str, str] | None:
    for name, shape in experts:
        if why := SCHEMES[scheme].misfit(shape):
            return name, why
    return None


def block_tp_sizes(expert_widths: set[int], block: int) -> list[int]:
    """Tensor-parallel sizes at which every rank's share of each expert width is whole blocks, as
    vLLM's block-FP8 MoE requires (e.g. width 768 stops at TP=4: 192 is not a multiple of 128).
    Expert parallelism keeps experts whole and is not limited by this."""
    return [tp for tp in TP_SIZES if all(width % (tp * block) == 0 for width in expert_widths)]
