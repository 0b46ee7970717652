"""The README's compatibility table is the one engines.LOADS renders, and each "yes" names a real test."""

from pathlib import Path

from quantize_moe.plan.compatibility import LOADS, PROVEN_BY, compatibility_table

ROOT = Path(__file__).resolve().parents[1]


def test_readme_table_is_rendered_from_engines_loads():
    assert compatibility_table() in (ROOT / "README.md").read_text()


def test_every_yes_names_a_test_file_that_loads_in_that_engine():
    for verdicts in LOADS.values():
        for engine, verdict in verdicts.items():
            if verdict == "yes":
                assert (ROOT / PROVEN_BY[engine]).is_file(), engine
