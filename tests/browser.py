"""JupyterLab in headless Chromium, driven through Selenium: the browser tests' fixtures.

The `lab` fixture starts a JupyterLab server on a free local port in a fresh directory (with
copies of the notebooks), and a headless Chromium from the system's packages (`chromium`,
`chromium-driver`; nothing is downloaded). `Lab` opens notebooks and runs cells through
JupyterLab's own command registry, reads what the page shows, and clicks what a person
clicks. Screenshots go to $NITRO_TEST_ARTIFACTS (default: tests/artifacts/).

Without the browser the tests skip, saying how to install it (`make browser`).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from notebook_kernel import REPO, kernel_env
from ports import free_port as _free_port

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
# The machines these tests run on have no network beyond package registries: keep Chromium
# from reaching out (and from waiting on it).
CHROMIUM_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-dev-shm-usage",
    "--window-size=1400,1000",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
)
INSTALL_HINT = (
    "the browser tests need Chromium and its driver from the system's packages: `make browser` "
    "installs them as root (apt-get install chromium chromium-driver)"
)
ARTIFACTS = Path(os.environ.get("NITRO_TEST_ARTIFACTS", REPO / "tests" / "artifacts"))

# JupyterLab settings for a quiet, deterministic page: no news or update checks (the machine
# has no network), every cell kept in the page (no windowing), no autosave surprises.
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false",
        "checkForUpdates": False,
    },
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
}


def require_browser() -> None:
    """Skip (with the install command) when Chromium, its driver or the Python packages are
    missing."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if missing:
        pytest.skip(f"{', '.join(missing)} not found: {INSTALL_HINT}")
    pytest.importorskip("selenium", reason="selenium is in the dev extra: pip install -e '.[dev]'")
    pytest.importorskip("jupyterlab", reason="jupyterlab is in the dev extra")


class Lab:
    """One JupyterLab server and one browser page on it."""

    def __init__(self, root: Path):
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        self.root = root
        self.port = _free_port()
        self.token = secrets.token_hex(16)
        home = root.parent / "jupyter-home"
        settings = home / "settings"
        for name, values in LAB_SETTINGS.items():
            path = settings / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        env = kernel_env()
        env.update(
            JUPYTERLAB_SETTINGS_DIR=str(settings),
            JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"),
            JUPYTER_CONFIG_DIR=str(home / "config"),
            JUPYTER_RUNTIME_DIR=str(home / "runtime"),
        )
        self.log = open(home / "server.log", "w")  # noqa: SIM115 - closed in close()
        self.server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jupyterlab",
                "--no-browser",
                f"--port={self.port}",
                "--ServerApp.ip=127.0.0.1",
                "--ServerApp.allow_root=True",  # CI runs as root
                "--ServerApp.terminals_enabled=False",
                f"--IdentityProvider.token={self.token}",
                f"--ServerApp.root_dir={root}",
                "--LabApp.expose_app_in_browser=True",
                "--LabApp.extension_manager=readonly",
            ],
            cwd=root,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.driver = None
        try:
            self._wait_for_server()
            options = webdriver.ChromeOptions()
            options.binary_location = CHROMIUM
            for flag in CHROMIUM_FLAGS:
                options.add_argument(flag)
            self.driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
            self.driver.set_script_timeout(120)
            self.driver.get(f"http://127.0.0.1:{self.port}/lab?token={self.token}")
            self.wait_for("!!window.jupyterapp", timeout=90, what="JupyterLab to load")
            self.js("await window.jupyterapp.started; await window.jupyterapp.restored;")
            self.dismiss_toasts()
            self.js("app.shell.collapseLeft();")
        except BaseException:
            self.close()
            raise

    def _wait_for_server(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{self.port}/api/status?token={self.token}"
        while True:
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            if self.server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"JupyterLab did not start; its log:\n{Path(self.log.name).read_text()}"
                )
            time.sleep(0.3)

    def close(self) -> None:
        if self.driver is not None:
            self.driver.quit()
        self.server.terminate()
        try:
            self.server.wait(20)
        except subprocess.TimeoutExpired:
            self.server.kill()
        self.log.close()

    # ------------------------------------------------------------------------------------------
    # the page

    def js(self, body: str, *args):
        """Run `body` as the body of an async function (`app` is JupyterLab, `nb` the current
        notebook panel, `args` the arguments) and return its result."""
        script = (
            "const args = arguments; const app = window.jupyterapp;"
            "const nb = app.shell.currentWidget;"
            f"return (async () => {{ {body} }})();"
        )
        return self.driver.execute_script(script, *args)

    def wait_for(self, expression: str, timeout: float = 120, *args, what: str = "") -> object:
        """Poll a JavaScript expression until it is truthy; returns its value."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.driver.execute_script(f"return ({expression});", *args)
            if value:
                return value
            if time.monotonic() > deadline:
                shot = self.screenshot("timeout")
                raise TimeoutError(f"{what or expression} not true within {timeout} s ({shot})")
            time.sleep(0.1)

    def dismiss_toasts(self) -> None:
        """Close any notification (JupyterLab's news question among them)."""
        self.driver.execute_script(
            "document.querySelectorAll('.jp-toast-button, .Toastify__close-button')"
            ".forEach(b => { if (/no|close|dismiss/i.test(b.textContent + b.title)) b.click(); });"
        )

    def screenshot(self, name: str, element=None) -> Path:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / f"{name}.png"
        if element is not None:
            element.screenshot(str(path))
        else:
            self.driver.save_screenshot(str(path))
        return path

    # ------------------------------------------------------------------------------------------
    # notebooks

    def open(self, name: str) -> None:
        """Open a notebook and wait until its kernel is idle. A notebook an earlier test left
        open (one that failed before closing it) is shut down first, so that its kernel stops
        competing for the CPU and its toolbar can't be the one a click finds."""
        self.js(
            "for (const w of [...app.shell.widgets('main')]) {"
            "  if (w.sessionContext) { await w.sessionContext.shutdown(); } w.dispose(); }"
        )
        self.js(
            "const panel = await app.commands.execute('docmanager:open', {path: args[0]});"
            "await panel.context.ready; await panel.sessionContext.ready;"
            "app.shell.activateById(panel.id);",
            name,
        )
        self.wait_for_kernel("idle", timeout=120)

    def wait_for_kernel(self, status: str, timeout: float = 120) -> None:
        self.wait_for(
            "window.jupyterapp.shell.currentWidget.sessionContext.session?.kernel?.status"
            " === arguments[0]",
            timeout,
            status,
            what=f"the kernel {status}",
        )

    def cell_count(self) -> int:
        return self.js("return nb.content.widgets.length;")

    def set_source(self, index: int, source: str) -> None:
        self.js("nb.content.widgets[args[0]].model.sharedModel.setSource(args[1]);", index, source)

    def insert_cell(self, index: int, source: str) -> None:
        """A new code cell at `index`."""
        self.js(
            "nb.content.model.sharedModel.insertCell(args[0], {cell_type: 'code', source: args[1]});",
            index,
            source,
        )

    def start(self, index: int) -> None:
        """Run cell `index` (as Shift+Enter does) without waiting for it."""
        self.js(
            "nb.content.activeCellIndex = args[0];"
            "app.commands.execute('notebook:run-cell'); return null;",
            index,
        )
        self.wait_for(
            "window.jupyterapp.shell.currentWidget.content.widgets[arguments[0]]"
            ".node.querySelector('.jp-InputPrompt').textContent.includes('[*]')"
            " || window.jupyterapp.shell.currentWidget.content.widgets[arguments[0]]"
            ".model.executionCount !== null",
            30,
            index,
            what=f"cell {index} to start",
        )

    def running(self, index: int) -> bool:
        return self.js(
            "return nb.content.widgets[args[0]].node.querySelector('.jp-InputPrompt')"
            ".textContent.includes('[*]');",
            index,
        )

    def wait_done(self, index: int, timeout: float = 120) -> None:
        """Wait until cell `index` no longer shows `[*]` and the kernel is idle."""
        deadline = time.monotonic() + timeout
        while self.running(index):
            if time.monotonic() > deadline:
                raise TimeoutError(f"cell {index} still running after {timeout} s")
            time.sleep(0.1)
        self.wait_for_kernel("idle", timeout=max(5.0, deadline - time.monotonic()))

    def run(self, index: int, timeout: float = 120) -> str:
        """Run cell `index` to the end; returns the text of its outputs."""
        self.start(index)
        self.wait_done(index, timeout)
        return self.output_text(index)

    def output_text(self, index: int) -> str:
        return self.js(
            "const area = nb.content.widgets[args[0]].node.querySelector('.jp-OutputArea');"
            "return area ? area.innerText : '';",
            index,
        )

    def panel(self, index: int) -> dict:
        """What cell `index`'s run panel shows: live widgets (bar width in %, its style,
        status text, Stop button, how many pixels its content overflows its box) or the static
        record (its text, images)."""
        return self.js(
            r"""
            const area = nb.content.widgets[args[0]].node.querySelector('.jp-OutputArea');
            if (!area) return {};
            const bar = area.querySelector('.progress-bar');
            const button = [...area.querySelectorAll('button')].find(
                b => /Stop|Interrupt/.test(b.textContent));
            const record = area.querySelector('.nitro-record');
            const panel = area.querySelector('.widget-vbox');
            const boxes = panel ? [panel, panel.closest('.jp-OutputArea-output')] : [];
            const status = [...area.querySelectorAll('.widget-html-content')].map(
                e => e.innerText).find(t => / step \d+/.test(t)) || '';
            return {
                widgets: !!area.querySelector('.jupyter-widgets'),
                overflow: Math.max(0, ...boxes.map(b => b.scrollWidth - b.clientWidth)),
                bar: bar ? parseFloat(bar.style.width) : null,
                barClass: bar ? bar.className : '',
                status: status,
                step: (status.match(/ step (\d+)/) || [])[1] | 0,
                button: button ? button.textContent.trim() : null,
                buttonEnabled: button ? !button.disabled : false,
                record: record ? record.innerText : null,
                images: area.querySelectorAll('img').length,
                text: area.innerText,
            };
            """,
            index,
        )

    def click_stop(self, index: int) -> None:
        """Click the Stop button of cell `index`'s panel, as a person does."""
        from selenium.webdriver.common.by import By

        for button in self.output(index).find_elements(By.CSS_SELECTOR, "button"):
            if button.text.strip() == "Stop":
                button.click()
                return
        raise AssertionError(f"no Stop button in cell {index}: {self.panel(index)}")

    def click_interrupt(self) -> None:
        """The notebook toolbar's interrupt button (■)."""
        from selenium.webdriver.common.by import By

        panel = self.driver.execute_script("return window.jupyterapp.shell.currentWidget.node;")
        panel.find_element(
            By.CSS_SELECTOR, '.jp-NotebookPanel-toolbar [data-command="notebook:interrupt-kernel"]'
        ).click()

    def cell(self, index: int):
        """Cell `index`'s element, scrolled to the top of the notebook's view."""
        return self.driver.execute_script(
            "const node = window.jupyterapp.shell.currentWidget.content.widgets[arguments[0]]"
            ".node; node.scrollIntoView({block: 'start'}); return node;",
            index,
        )

    def output(self, index: int):
        """The output area element of cell `index`."""
        from selenium.webdriver.common.by import By

        cell = self.driver.execute_script(
            "return window.jupyterapp.shell.currentWidget.content.widgets[arguments[0]].node;",
            index,
        )
        return cell.find_element(By.CSS_SELECTOR, ".jp-OutputArea")

    def save_and_close(self) -> None:
        self.js("await nb.context.save(); await nb.sessionContext.shutdown(); nb.dispose();")
        self.wait_for(
            "!document.querySelector('.jp-NotebookPanel')", 120, what="the notebook to close"
        )


def copy_notebooks(root: Path) -> None:
    for notebook in (REPO / "notebooks").glob("*.ipynb"):
        shutil.copy(notebook, root / notebook.name)
