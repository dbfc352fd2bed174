"""The fusion report as one self-contained HTML page: inline CSS and SVG, no script, no external
URL. No TVM import (the API renders it). Every string from the report is escaped: the names in
it come from the user's model.
"""

from __future__ import annotations

from html import escape
from typing import Any

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:2em;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 8px;
text-align:left;vertical-align:top}th{background:#f3f3f3}.ok{color:#176117}.no{color:#9a2b00}
code{font-size:12px}svg{display:block;margin:.5em 0 1.5em}
"""


def _e(value: Any) -> str:
    return escape(str(value), quote=True)


def _names(names: dict[str, Any] | None) -> str:
    n = names or {}
    bits = [f"layer {n['layer']}"] if n.get("layer") is not None else []
    bits += [n["module"]] if n.get("module") else []
    bits += [p for p in n.get("projections", []) if p != n.get("module")]
    return _e(", ".join(map(str, bits)))


def _dataflow(m: dict[str, Any], index: int) -> str:
    """stacked tensor -> split/slices -> q, k, v -> attention; replaced bindings in red."""
    shapes = m.get("shapes", {})
    layout = m.get("layout", {})
    replaced = ", ".join(map(str, m.get("bindings", [])))
    stacked = m.get("kind") == "stacked"
    src = "qkv" if stacked else "q, k, v"
    op = {
        "split": "R.split",
        "strided_slice": "R.strided_slice x3",
        "interleaved": "per-head split",
    }
    boxes = [
        (10, f"{src} {shapes.get('qkv', '')}" if stacked else src, False),
        (200, op.get(str(m.get("variant")), "(separate tensors)"), stacked),
        (390, "reshape q / k / v", stacked),
        (580, f"R.nn.attention -> {m.get('where', {}).get('binding', '')}", True),
    ]
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="800" height="150" '
        f'role="img" aria-label="dataflow of site {index}">'
    ]
    for x, label, gone in boxes:
        style = 'stroke="#c0392b" stroke-dasharray="5,3"' if gone else 'stroke="#333"'
        parts.append(
            f'<rect x="{x}" y="20" width="170" height="50" fill="#fff" {style}/>'
            f'<text x="{x + 85}" y="50" font-size="11" text-anchor="middle">{_e(label)}</text>'
        )
    for x in (180, 370, 560):
        parts.append(f'<line x1="{x}" y1="45" x2="{x + 20}" y2="45" stroke="#333"/>')
    offsets = (
        f"q at {layout.get('q_offset')}, k at {layout.get('k_offset')}, "
        f"v at {layout.get('v_offset')}; row stride {layout.get('row_stride', {})}"
    )
    parts.append(f'<text x="10" y="95" font-size="11">offsets: {_e(offsets)}</text>')
    parts.append(
        f'<text x="10" y="115" font-size="11" fill="#c0392b">replaced by one kernel '
        f"(dashed): {_e(replaced)}</text>"
    )
    parts.append("</svg>")
    return "".join(parts)


def render(doc: dict[str, Any]) -> str:
    """The page for a report (``worker.report.Report`` as JSON)."""
    s = doc.get("summary", {})
    matches = {m["where"]["site"]: m for m in doc.get("matches", [])}
    gemms = {g["where"]["site"]: g for g in doc.get("gemms", [])}
    failures: dict[str, list[dict[str, Any]]] = {}
    for f in doc.get("check_failures", []):
        failures.setdefault(f["where"]["site"], []).append(f)
    rows = []
    for site in doc.get("sites", []):
        sid = site["where"]["site"]
        detail = matches.get(sid) if site["kind"] == "attention" else gemms.get(sid)
        kernel = (detail or {}).get("kernel") or {}
        fails = failures.get(sid, []) if site["kind"] == "attention" else []
        fails = fails or ((detail or {}).get("check_failures") or [])
        checks = "<br>".join(
            f"<code>{_e(f['check'])}</code>: expected {_e(f['expected'])}, actual {_e(f['actual'])}"
            for f in fails
        )
        cls = "ok" if site.get("offloaded") else "no"
        rows.append(
            f"<tr><td><code>{_e(sid)}</code></td><td>{_e(site['kind'])}</td>"
            f"<td>{_names(site.get('names'))}</td>"
            f'<td class="{cls}">{_e(site["verdict"])}</td>'
            f"<td>{_e(kernel.get('family', ''))}</td><td>{_e(kernel.get('reason', ''))}"
            f"{_e((detail or {}).get('reason', '') if not kernel else '')}</td>"
            f"<td>{checks}</td></tr>"
        )
    pictures = "".join(
        f"<h3><code>{_e(sid)}</code> {_names(m.get('names'))}</h3>{_dataflow(m, i)}"
        for i, (sid, m) in enumerate(matches.items())
    )
    lib = doc.get("library") or {}
    summary = (
        f"{_e(s.get('attention_sites', 0))} attention site(s): "
        f"{_e(s.get('fused_stacked', 0))} fused stacked, {_e(s.get('fused_plain', 0))} fused "
        f"plain, {_e(s.get('not_offloaded', 0))} left to TVM; {_e(s.get('gemm_sites', 0))} "
        f"matmul(s): {_e(s.get('gemm_offloaded', 0))} on CUTLASS"
    )
    error = doc.get("error")
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>Stackfuse report {_e(doc.get('input_sha256', '')[:12])}</title>"
        f"<style>{_CSS}</style></head><body>"
        f"<h1>Fusion report</h1><p>{summary}</p>"
        f"<p>target {_e(doc.get('target', {}).get('arch', ''))}; library "
        f"<code>{_e(lib.get('file', '-'))}</code> ({_e(lib.get('size_bytes', '-'))} bytes); "
        f"compile {_e(doc.get('compile_s', 0))} s"
        f"{' (from the compile cache)' if doc.get('cached') else ''}; "
        f"validation: {_e(str(doc.get('validation', {}).get('status', '')).replace('_', ' '))}</p>"
        + (f'<p class="no">error: {_e(error)}</p>' if error else "")
        + "<h2>Sites</h2><table><tr><th>site</th><th>kind</th><th>names</th><th>verdict</th>"
        "<th>kernel</th><th>reason</th><th>failed checks (expected vs actual)</th></tr>"
        + "".join(rows)
        + "</table><h2>Dataflow of each fused attention site</h2>"
        + (pictures or "<p>no attention site was fused</p>")
        + "</body></html>"
    )
