"""Shared by the config tests: a config's docstring points to the results file that holds
its measured numbers (`Measured: ... results/<name>.md`), and that file exists."""

import pathlib
import re

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "results"


def cites_results(doc: str) -> bool:
  m = re.search(r"Measured: .*?results/([\w.-]+\.md)", doc or "", re.S)
  return bool(m) and (RESULTS / m.group(1)).is_file()
