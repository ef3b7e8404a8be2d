"""The live panel's gallery in a real kernel: validation samples with the current
predictions, drawn off the training thread, kept in the run's static record; a `visualize`
that raises is reported once and the run goes on."""

from __future__ import annotations

import base64
import re
from io import BytesIO

from notebook_kernel import kernel_fixture  # noqa: F401 - provides the `kernel` fixture
from PIL import Image


def _saved(kernel, cell_id: str) -> list[dict]:
    import nbformat

    outputs = kernel.outputs(cell_id)
    nbformat.validate(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(outputs=outputs)]))
    return [o for o in outputs if o["output_type"] == "display_data"]


def _gallery(html: str) -> Image.Image:
    found = re.search(
        r"<div class='nitro-gallery'><img [^>]*src='data:image/png;base64,([^']+)'", html
    )
    assert found, html[-2000:]
    return Image.open(BytesIO(base64.b64decode(found.group(1))))


def test_a_run_with_a_visualize_hook_shows_a_gallery_and_keeps_it_in_its_record(kernel):
    kernel.run("from nitro.examples.digits import Digits\ngal = Digits(max_epochs=2)")
    cell = kernel.run("%nitro train gal")
    summary, _curves = _saved(kernel, cell.msg_id)
    image = _gallery(summary["data"]["text/html"])
    assert image.width > 400 and image.height > 200
    pngs = [
        bytes(m["buffers"][0])
        for m in cell.messages
        if m["msg_type"] == "comm_msg"
        and m["content"]["data"].get("buffer_paths") == [["value"]]
        and m.get("buffers")
    ]
    sizes = [Image.open(BytesIO(png)).size for png in pngs]
    assert image.size in sizes  # the live panel showed the gallery the record keeps


def test_a_visualize_that_raises_is_reported_once_and_the_run_goes_on(kernel):
    kernel.run(
        """
        from nitro.examples.digits import Digits

        @nitro.experiment
        class Smudged(Digits):
            def visualize(self, sample, output=None):
                raise RuntimeError("no drawing today")

        smudged = Smudged(max_epochs=3)
        """
    )
    cell = kernel.run("%nitro train smudged")
    summary, _curves = _saved(kernel, cell.msg_id)
    html = summary["data"]["text/html"]
    assert "<b>done</b> &middot; epoch 3/3" in html
    assert html.count("visualize raised RuntimeError: no drawing today") == 1
    assert "raise RuntimeError(&quot;no drawing today&quot;)" in html  # its line
    _gallery(html)  # drawn by the default view instead
