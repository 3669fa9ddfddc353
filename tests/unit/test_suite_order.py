"""`make test`'s file order: its two pytest-xdist workers take whole files (``--dist loadfile``) in the order of
``tests/conftest.py``'s ``LONGEST_FIRST``, so neither ends the run on a minutes-long flow file the other could have
started earlier."""

import re

from grpo_steps.config import REPO_ROOT
from tests.conftest import LONGEST_FIRST


def test_every_longest_first_name_is_a_test_file():
    """A renamed or merged file left in the list would silently lose its place at the front."""
    files = {path.name for path in (REPO_ROOT / "tests").rglob("test_*.py")}
    assert set(LONGEST_FIRST) <= files, set(LONGEST_FIRST) - files


def test_make_test_keeps_the_collection_order():
    """xdist's default (``--loadscope-reorder``) sends the files with the most tests first: the order above would
    not hold."""
    recipe = re.search(r"^test: .*\n((?:\t.*\n)+)", (REPO_ROOT / "Makefile").read_text(), re.M).group(1)
    assert "--dist loadfile" in recipe and "--no-loadscope-reorder" in recipe, recipe
