"""Reading the ignore list of a quantization_config that came from an untrusted checkpoint.

Entries are exact module names or `re:` patterns matched from the start (compressed-tensors).
A pattern is code run by our process, so it must be bounded before it is used: nested or
alternated repetition (`(.+)+X`) backtracks exponentially, and many unbounded repeats in a row
polynomially; such patterns are refused with the entry named, as are malformed ones.
"""

from __future__ import annotations

import re
from collections.abc import Callable

try:
    import re._parser as _sre_parse  # Python 3.11+
    from re._constants import BRANCH, MAX_REPEAT, MAXREPEAT, MIN_REPEAT
except ImportError:  # pragma: no cover - Python 3.10
    import sre_parse as _sre_parse
    from sre_constants import BRANCH, MAX_REPEAT, MAXREPEAT, MIN_REPEAT

from quantize_moe.errors import UserError

IGNORE_KEYS = ("ignored_layers", "modules_to_not_convert", "ignore")
MAX_PATTERN_CHARS = 500
MAX_UNBOUNDED_REPEATS = 3  # real configs use one or two (`re:.*\.mlp\..*gate$`)
_REPEATS = {MAX_REPEAT, MIN_REPEAT} | ({getattr(_sre_parse, "POSSESSIVE_REPEAT")}
                                      if hasattr(_sre_parse, "POSSESSIVE_REPEAT") else set())


def ignore_entries(quantization_config: dict, where: str) -> list[str]:
    """Every entry under the ignore keys, checked to be a list of strings."""
    entries = []
    for key in IGNORE_KEYS:
        value = quantization_config.get(key) or []
        if not isinstance(value, list) or not all(isinstance(e, str) for e in value):
            raise UserError(f"{where}: quantization_config.{key} must be a list of module names (strings), "
                            f"not {value!r:.80}; fix the config.")
        entries += value
    return entries


def ignore_matcher(quantization_config: dict, where: str) -> tuple[list[str], Callable[[str], bool]]:
    """The entries, and whether a module name is ignored by them."""
    entries = ignore_entries(quantization_config, where)
    exact = {e for e in entries if not e.startswith("re:")}
    patterns = [_safe_pattern(e, where) for e in entries if e.startswith("re:")]
    return entries, lambda module: module in exact or any(p.match(module) for p in patterns)


def _safe_pattern(entry: str, where: str) -> re.Pattern:
    body = entry[3:]
    refuse = f"{where}: the ignore entry {entry[:80]!r} "
    if len(body) > MAX_PATTERN_CHARS:
        raise UserError(refuse + f"is longer than {MAX_PATTERN_CHARS} characters; shorten it or list module names.")
    try:
        parsed = _sre_parse.parse(body)
        compiled = re.compile(body)
    except (re.error, RecursionError, OverflowError) as e:
        raise UserError(refuse + f"is not a valid regular expression ({e}); fix it.") from None
    if _ambiguous(parsed, inside_repeat=False):
        raise UserError(refuse + "repeats a repetition or alternation (like '(.+)+'), which can take "
                        "exponential time to match; rewrite it without nested repetition.")
    if _unbounded_repeats(parsed) > MAX_UNBOUNDED_REPEATS:
        raise UserError(refuse + f"has more than {MAX_UNBOUNDED_REPEATS} unbounded repeats, which can take "
                        "very long to match; simplify it.")
    return compiled


def _items(node):
    """(op, argument) pairs of a parsed pattern, and the sub-patterns each argument holds."""
    for op, av in node:
        subs = [a for a in (av if isinstance(av, (tuple, list)) else [av]) if isinstance(a, _sre_parse.SubPattern)]
        if op is BRANCH:
            subs = list(av[1])
        yield op, av, subs


def _ambiguous(node, inside_repeat: bool) -> bool:
    for op, av, subs in _items(node):
        if op in _REPEATS and av[1] > 1:
            if inside_repeat:
                return True
            if any(_ambiguous(s, True) for s in subs):
                return True
        elif op is BRANCH and inside_repeat:
            return True
        elif any(_ambiguous(s, inside_repeat) for s in subs):
            return True
    return False


def _unbounded_repeats(node) -> int:
    return sum((op in _REPEATS and av[1] == MAXREPEAT) + sum(_unbounded_repeats(s) for s in subs)
               for op, av, subs in _items(node))
