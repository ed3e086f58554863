"""experiments/quickstart.ipynb executes end to end on the smoke model (stories260K,
KVLOWRANK_SMOKE=1) in a fresh kernel, so the notebook cannot rot; its outputs hold the
evaluation table and the plot. Skipped without ../shared or without nbclient/ipykernel
(the `test` extra installs them)."""

import os
import sys
from pathlib import Path

import pytest

from kvlowrank.resources import shared_dir

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("ipykernel")
pytestmark = pytest.mark.skipif(shared_dir() is None, reason="../shared not available")
REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quickstart_notebook_executes(tmp_path, monkeypatch):
  nb = nbformat.read(REPO / "experiments" / "quickstart.ipynb", as_version=4)
  monkeypatch.setenv("KVLOWRANK_SMOKE", "1")
  monkeypatch.setenv("KVLOWRANK_CACHE", str(tmp_path / "cache"))
  # The kernel imports this checkout's kvlowrank (the test process's path).
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in sys.path if p))
  client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                   resources={"metadata": {"path": str(tmp_path)}})
  client.execute()
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
  text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
  assert not [o for o in outputs if o.get("output_type") == "error"]
  for name in ("dense", "kivi-2", "palu-50%"):
    assert f"\n{name}" in text or text.startswith(name)
  assert "KiviSpec.residual=32" in text  # the exact-window note of a short generation
  assert "palu: calibration saved to" in text and (tmp_path / "cache" / "calib").is_dir()
  assert any("image/png" in o.get("data", {}) for o in outputs)  # the bytes-vs-PPL plot
