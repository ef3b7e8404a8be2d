"""`n.summary()` as a cell's last expression in a real kernel: the layer table as HTML beside
its text, and still the table once treescope renders everything else (a real kernel)."""

from __future__ import annotations

import re

from notebook_kernel import kernel_fixture  # noqa: F401 - provides the `kernel` fixture


def _result(cell) -> dict[str, str]:
    (result,) = [m for m in cell.messages if m["msg_type"] == "execute_result"]
    return result["content"]["data"]


def _html_rows(html: str) -> list[list[str]]:
    body = html.split("<tbody>", 1)[1].split("</tbody>", 1)[0]
    return [
        [re.sub(r"<[^>]+>", "", cell).strip() for cell in re.findall(r"<td[^>]*>(.*?)</td>", row)]
        for row in re.findall(r"<tr>(.*?)</tr>", body)
    ]


def test_summary_renders_as_an_html_layer_table_with_its_text_beside_it(kernel):
    cell = kernel.run("summ = nitro.Nitro(tiny_exp.Tiny(), progress=False)\nsumm.summary()")
    data = _result(cell)
    html, text = data["text/html"], data["text/plain"]
    assert html.startswith("<table><caption>Net: output shapes for one batch")
    assert _html_rows(html) == [
        ["(model)", "Net", "f32[8,2]", "58", "232 B"],
        ["hidden", "Linear", "f32[8,8]", "40", "160 B"],
        ["out", "Linear", "f32[8,2]", "18", "72 B"],
    ]
    assert "<th style='text-align:left'>parameters</th>" in html and "58 (232 B)" in html
    lines = text.splitlines()
    assert lines[0] == "Net: output shapes for one batch (the 'train' split's batch: x f32[8,4])"
    assert re.search(r"^  hidden +Linear +f32\[8,8\] +40 +160 B$", text, re.M), text
    assert "parameters: 58 (232 B)" in lines
    assert kernel.eval("summ.param_count") == "58"

    # with treescope rendering every other value, the summary stays the table
    cell = kernel.run("import treescope\ntreescope.basic_interactive_setup()\nsumm.summary()")
    assert _result(cell)["text/html"] == html
    model = _result(kernel.run("summ.model"))
    assert "<table>" not in model["text/html"] and "treescope" in model["text/html"]
    assert "hidden=Linear(" in model["text/plain"]
