"""The report page, rendered from a real compile's report.json, read by a real headless browser."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory, module_json: str) -> Path:
    """`stackfuse compile` of the session's module: its report.json."""
    d = tmp_path_factory.mktemp("report-html")
    (d / "model.json").write_text(module_json)
    done = subprocess.run(
        [sys.executable, "-m", "service.cli", "compile", str(d / "model.json"), "--out", str(d)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return d / "report.json"


def _cli_page(report: Path) -> str:
    out = report.with_suffix(".html")
    done = subprocess.run(
        [sys.executable, "-m", "service.cli", "report", str(report), "-o", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return out.read_text()


@pytest.mark.slow
@pytest.mark.nvcc
def test_the_page_references_no_external_url_and_escapes_names(compiled: Path) -> None:
    page = _cli_page(compiled)
    assert not re.search(r"""(src|href)\s*=|url\(|@import|<script""", page, re.I), page
    assert all(u == "http://www.w3.org/2000/svg" for u in re.findall(r"https?://[^\s\"'<]+", page))
    doc = json.loads(compiled.read_text())
    doc["sites"][0]["names"]["module"] = "<script>alert(1)</script>"
    hostile = compiled.with_name("hostile.json")
    hostile.write_text(json.dumps(doc))
    page = _cli_page(hostile)
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page


@pytest.mark.slow
@pytest.mark.nvcc
@pytest.mark.skipif(CHROMIUM is None, reason="no chromium here (apt-get install chromium)")
def test_a_browser_shows_the_summary_sites_and_dataflow(compiled: Path, tmp_path: Path) -> None:
    page = Path(_cli_page(compiled) and compiled.with_suffix(".html"))
    assert CHROMIUM is not None
    dom = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path}",
         "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120,
    ).stdout  # fmt: skip
    doc = json.loads(compiled.read_text())
    site = doc["sites"][0]
    assert "1 fused stacked" in dom
    assert site["where"]["site"] in dom and site["verdict"] in dom
    assert "<svg" in dom and 'aria-label="dataflow of site 0"' in dom
    for binding in doc["matches"][0]["bindings"]:
        assert binding in dom
    assert doc["matches"][0]["kernel"]["family"] in dom
