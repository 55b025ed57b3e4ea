"""Headless Chromium for the feature browser: a screenshot for reports, and the driver
the browser test uses. Needs Debian's ``chromium`` and ``chromium-driver`` (``./dev setup``
installs them) and selenium; the driver is never downloaded."""

from __future__ import annotations

import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
)  # fmt: skip
CHROMEDRIVER = "/usr/bin/chromedriver"


def chromium_missing() -> str | None:
    """Why headless Chromium cannot run here, or None when it can."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install selenium; it is in the dev extra)"
    if not Path(CHROMEDRIVER).is_file():
        return f"{CHROMEDRIVER} not found (apt-get install chromium chromium-driver)"
    if not (shutil.which("chromium") or shutil.which("chromium-browser")):
        return "chromium not found (apt-get install chromium chromium-driver)"
    return None


@contextmanager
def chromium(width: int = 1400, height: int = 900):
    """A selenium WebDriver of headless Chromium with a fresh profile, quit on exit."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        options = webdriver.ChromeOptions()
        for flag in (
            *CHROMIUM_FLAGS,
            f"--user-data-dir={profile}",
            f"--window-size={width},{height}",
        ):
            options.add_argument(flag)
        driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
        try:
            yield driver
        finally:
            driver.quit()


def screenshot(index: str | Path, png: str | Path, *, latent: int | None = None) -> Path | None:
    """A PNG of the browser at ``index`` (opened from disk), with ``latent`` (default: the
    first of the list) opened; None when Chromium is not available here."""
    if chromium_missing():
        return None
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    with chromium() as driver:
        driver.get(Path(index).resolve().as_uri())
        rows = driver.find_elements(By.CSS_SELECTOR, "tr.latent-row")
        if rows:
            target = rows[0] if latent is None else driver.find_element(
                By.CSS_SELECTOR, f'tr.latent-row[data-latent="{latent}"]')  # fmt: skip
            target.click()
            WebDriverWait(driver, 10).until(
                lambda d: d.find_elements(By.CSS_SELECTOR, ".context") or
                d.find_elements(By.CSS_SELECTOR, "#detail .muted"))  # fmt: skip
        Path(png).parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(png))
    return Path(png)
