"""The calendar page in a real headless Chromium (the distribution's chromium and chromium-driver, driven by
selenium; nothing is downloaded): against a control plane on loopback with known bookings, the bars sit where
their windows say and carry their labels, zoom changes their widths, the cursor is at now, the tenant view shows
only the tenant's reservations and the free devices, and the token never reaches the URL. Screenshots are saved
under the test's tmp directory (the paths are printed)."""
from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from controlplane import fleet
from tests.controlplane.conftest import HOUR, T0, TOKENS

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed: pip install -e '.[test]'")
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="no chromium or chromedriver here: apt-get install "
                                "-y chromium chromium-driver (.ci/run does)")
ADMIN = "admin-token-for-tests-0001"
VIEW_FROM = T0 - HOUR  # the page's left edge, from its URL fragment
TOLERANCE_PX = 2.5


def browser(profile: Path):
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the console, for errors the page caused
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1500,1000",
                f"--user-data-dir={profile}", "--no-first-run", "--no-default-browser-check", "--disable-extensions",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-features=Translate,OptimizationHints,MediaRouter", "--metrics-recording-only"):
        opts.add_argument(arg)
    return webdriver.Chrome(service=Service(executable_path=DRIVER), options=opts)


class Page:
    """What the test reads of the page: rows, bars and their geometry, through the DOM."""

    def __init__(self, driver):
        self.d = driver

    def wait(self, script: str, *args, timeout: float = 15):
        WebDriverWait(self.d, timeout).until(lambda d: d.execute_script(script, *args))

    def sign_in(self, token: str, view: str) -> None:
        self.d.execute_script("document.body.dataset.ready = ''")
        field = self.d.find_element(By.ID, "token")
        field.send_keys(token)
        self.d.find_element(By.CSS_SELECTOR, "#login button").click()
        self.wait(f"return document.body.dataset.ready === 'true' && document.body.dataset.view === '{view}'")

    def bars(self, row: str) -> list[dict]:
        return self.d.execute_script("""
            const row = document.querySelector(`.row[data-row="${arguments[0]}"]`);
            if (!row) return null;
            if (!row.querySelector('.track')) return [];  // a heading row
            const track = row.querySelector('.track').getBoundingClientRect();
            return [...row.querySelectorAll('.bar, .free-step')].map(b => {
                const r = b.getBoundingClientRect();
                return {text: b.textContent, cls: b.className, data: {...b.dataset},
                        left: (r.left - track.left) / track.width, width: r.width / track.width,
                        leftPx: r.left - track.left, widthPx: r.width, trackPx: track.width};
            });""", row)

    def bar_of(self, row: str, reservation: str) -> dict:
        """The reservation's bar in the row, once the page has drawn it (a load may still be under way)."""
        self.wait("return [...document.querySelectorAll(`.row[data-row=\"${arguments[0]}\"] .bar`)]"
                  ".some(b => b.dataset.reservation === arguments[1])", row, reservation)
        [found] = [b for b in self.bars(row) if b["data"].get("reservation") == reservation]
        return found

    def rows(self) -> list[str]:
        return self.d.execute_script("return [...document.querySelectorAll('#rows .row')].map(r => r.dataset.row)")

    def cursor(self) -> float:
        """Where the now-cursor stands, as a fraction of the tracks."""
        return self.d.execute_script("""
            const c = document.getElementById('cursor').getBoundingClientRect();
            const t = document.querySelector('#rows .row .track, #axis .track').getBoundingClientRect();
            return (c.left - t.left) / t.width;""")

    def span_ms(self) -> int:
        return {"6h": 6, "12h": 12, "1d": 24, "3d": 72, "7d": 168}[self.d.find_element(By.ID, "span").get_attribute(
            "value")] * HOUR

    def shot(self, path: Path) -> None:
        self.d.save_screenshot(str(path))
        print(f"screenshot: {path}")


def near(bar: dict, start: int, end: int, view_from: int, span: int) -> bool:
    """The bar's left edge and width within a few pixels of its window's place in the view (clipped to it)."""
    a, b = max(0.0, (start - view_from) / span), min(1.0, (end - view_from) / span)
    return abs(bar["leftPx"] - a * bar["trackPx"]) <= TOLERANCE_PX and \
        abs(bar["widthPx"] - (b - a) * bar["trackPx"]) <= TOLERANCE_PX


async def test_the_calendar_shows_the_known_bookings_where_they_are_for_operators_and_tenants(api, tmp_path,
                                                                                            monkeypatch):
    running = (await api.create(key="running", gpuCount=2, durationHours=2))[1]["reservation"]
    await api.settle()  # its window started: binding
    spot = (await api.create(key="spot", gpuCount=1, spot=True, start=T0 + 3 * HOUR, end=T0 + 5 * HOUR))[1]["reservation"]
    dave = (await api.create("dave", key="dave", gpuCount=1, start=T0 + HOUR, end=T0 + 2 * HOUR))[1]["reservation"]
    for r in (running, spot, dave):
        assert r["state"] in ("placed", "binding"), r
    node = running["placements"][0]["nodeId"]
    # A booking carried on past its window (a kubernetes release held by pods): the API says so, the page marks it.
    monkeypatch.setattr(fleet, "carried_on", lambda res: res.id == spot["id"])
    url = str(api.client.make_url("/ui/")) + f"#from={VIEW_FROM}&span=1d"
    shots = tmp_path / "screenshots"
    shots.mkdir()

    def drive() -> None:
        driver = browser(tmp_path / "profile")
        try:
            page = Page(driver)
            driver.get(url)
            page.sign_in(ADMIN, "operator")
            span = page.span_ms()
            assert 24 * HOUR == span
            # the node row carries every booking on the node; each GPU row the bookings of that GPU
            on_node = {b["data"]["reservation"]: b for b in page.bars(node)}
            assert {running["id"]} <= set(on_node)
            bar = on_node[running["id"]]
            assert "acme · binding · hold" == bar["text"] and "state-binding" in bar["cls"]
            assert near(bar, T0, T0 + 2 * HOUR, VIEW_FROM, span), bar
            for device in running["placements"][0]["devices"]:
                [gpu_bar] = [b for b in page.bars(f"{node}/{device}") if b["data"]["reservation"] == running["id"]]
                assert near(gpu_bar, T0, T0 + 2 * HOUR, VIEW_FROM, span), gpu_bar
            spot_node, [spot_device] = spot["placements"][0]["nodeId"], spot["placements"][0]["devices"]
            [spot_bar] = [b for b in page.bars(f"{spot_node}/{spot_device}") if b["data"]["reservation"] == spot["id"]]
            assert "acme · placed · hold · spot · carried on" == spot_bar["text"]
            assert {"spot", "carried-on", "state-placed"} <= set(spot_bar["cls"].split())
            assert ("true", "true") == (spot_bar["data"]["spot"], spot_bar["data"]["carriedOn"])
            assert near(spot_bar, T0 + 3 * HOUR, T0 + 5 * HOUR, VIEW_FROM, span), spot_bar
            dave_node = dave["placements"][0]["nodeId"]
            assert any(b["text"] == "initech · placed · hold" for b in page.bars(dave_node))
            assert abs(page.cursor() - (T0 - VIEW_FROM) / span) < 0.003  # the server's now, one hour in
            page.shot(shots / "operator-1d.png")

            driver.find_element(By.ID, "zoom-out").click()  # 1 day -> 3 days, around the view's centre
            page.wait("return document.getElementById('span').value === '3d'")
            page.wait("return document.body.dataset.ready === 'true'")
            span3 = page.span_ms()
            centre = VIEW_FROM + span // 2
            from3 = centre - span3 // 2
            bar3 = page.bar_of(node, running["id"])
            assert near(bar3, T0, T0 + 2 * HOUR, from3, span3), bar3
            assert abs(bar3["width"] * 3 - bar["width"]) < 0.01  # three times the span, a third of the width
            for _ in range(3):
                driver.find_element(By.ID, "zoom-in").click()  # 3 days -> 1 day -> 12 h -> 6 h
            page.wait("return document.getElementById('span').value === '6h'")
            # Zooming keeps the centre (T0 + 11 h): the 6 h view runs from T0 + 8 h, past the running booking.
            page.wait("return location.hash.includes(`from=${arguments[0]}`)", centre - 3 * HOUR)
            assert [] == [b for b in page.bars(node) if b["data"]["reservation"] == running["id"]]
            driver.find_element(By.ID, "now").click()  # back to now: the view starts a tenth of its span before now
            page.wait("return !location.hash.includes('from=')")
            bar6 = page.bar_of(node, running["id"])
            assert near(bar6, T0, T0 + 2 * HOUR, T0 - 6 * HOUR // 10, 6 * HOUR), bar6
            assert abs(bar6["width"] - bar["width"] * 4) < 0.01  # a quarter of the span, four times the width
            page.shot(shots / "operator-6h.png")
            assert ADMIN not in driver.current_url
            assert ADMIN == driver.execute_script("return sessionStorage.getItem('berth.token')")

            driver.find_element(By.ID, "logout").click()
            driver.get(url)
            driver.get_log("browser")  # (read: what follows is the tenant's)
            page.sign_in(TOKENS["alice"], "tenant")
            failed = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
            assert [] == failed  # a tenant's sign-in asks nothing that is refused (it used to probe the admin API)
            assert TOKENS["alice"] not in driver.current_url
            rows = page.rows()
            assert "free:h100" in rows and f"{node}/{running['placements'][0]['devices'][0]}" in rows
            mine = {b["data"]["reservation"] for r in rows for b in (page.bars(r) or []) if "reservation" in b["data"]}
            assert {running["id"], spot["id"]} == mine  # dave's booking is initech's: not shown
            steps = [(int(b["data"]["at"]), int(b["data"]["units"])) for b in page.bars("free:h100")]
            assert [(VIEW_FROM, 16), (T0, 14), (T0 + HOUR, 13), (T0 + 2 * HOUR, 16), (T0 + 3 * HOUR, 15),
                    (T0 + 5 * HOUR, 16)] == steps
            first = page.bars("free:h100")[1]
            assert "14 free" == first["text"] and near(first, T0, T0 + HOUR, VIEW_FROM, span)
            page.shot(shots / "tenant-1d.png")
        finally:
            driver.quit()

    def driven() -> None:
        try:
            drive()
        except StopIteration as e:  # a StopIteration cannot cross into a future: the test would hang
            raise AssertionError("an expected element was missing") from e

    await asyncio.wait_for(asyncio.to_thread(driven), 240)
    assert {"operator-1d.png", "operator-6h.png", "tenant-1d.png"} == {p.name for p in shots.iterdir()}


async def test_the_page_says_when_it_is_stale_counts_pending_work_and_leaves_keys_and_sign_out_alone(api, tmp_path):
    """Through the browser's own DevTools network switch: a load that fails shows a banner at the top and draws
    nothing for a window it never loaded; a sign-out while a load is on its way stays signed out; operators see
    each pool's pending work; shortcuts leave the browser's keys and the span selector alone; bars take focus;
    a hand-edited fragment cannot break the page."""
    await api.create(key="all", gpuCount=8, nodeCount=2)  # h100 full: the next one waits
    pending = (await api.create(key="waits", gpuCount=1))[1]["reservation"]
    assert "pending" == pending["state"]
    url = str(api.client.make_url("/ui/")) + f"#from={VIEW_FROM}&span=1d"

    def drive() -> None:
        driver = browser(tmp_path / "profile")
        try:
            page = Page(driver)
            driver.execute_cdp_cmd("Network.enable", {})
            driver.get(url)
            driver.execute_script("window.berthErrors = []; window.addEventListener('error', e => "
                                  "window.berthErrors.push(String(e.message)))")
            # a mistyped token is said to be none of the three this page takes (not "a tenant's only")
            driver.find_element(By.ID, "token").send_keys(ADMIN + "x")
            driver.find_element(By.CSS_SELECTOR, "#login button").click()
            page.wait("return document.getElementById('status').textContent.startsWith('This token is not accepted')")
            said = driver.find_element(By.ID, "status").text
            assert "no tenant principal's, no operator's and not the admin token" in said, said
            driver.find_element(By.ID, "token").clear()
            page.sign_in(ADMIN, "operator")
            head = driver.find_element(By.CSS_SELECTOR, '.row[data-row="pool:h100"]')
            assert ("1", "pool h100 · 1 pending (not placed yet)") == (head.get_attribute("data-pending"), head.text)
            bar = driver.find_element(By.CSS_SELECTOR, ".bar")
            assert "0" == bar.get_attribute("tabindex") and bar.get_attribute("aria-label")

            # keys: the span selector's arrows and Ctrl/Alt combinations are not the page's shortcuts
            before = driver.execute_script("return location.hash")
            span = driver.find_element(By.ID, "span")
            driver.execute_script("arguments[0].focus()", span)
            for key, mods in (("ArrowRight", {}), ("=", {"ctrlKey": True}), ("ArrowLeft", {"altKey": True})):
                driver.execute_script("document.activeElement.dispatchEvent(new KeyboardEvent('keydown', "
                                      "{key: arguments[0], bubbles: true, ...arguments[1]}))", key, mods)
            driver.execute_script("document.body.focus(); document.body.dispatchEvent(new KeyboardEvent('keydown', "
                                  "{key: '=', ctrlKey: true, bubbles: true}))")
            assert before == driver.execute_script("return location.hash")
            driver.execute_script("document.body.dispatchEvent(new KeyboardEvent('keydown', {key: 'ArrowRight', "
                                  "bubbles: true}))")  # the bare key still pans
            page.wait("return location.hash !== arguments[0]", before)

            # the control plane out of reach: a pan to a window never loaded shows nothing, and says so on top
            driver.execute_cdp_cmd("Network.emulateNetworkConditions", {"offline": True, "latency": 0,
                                                                         "downloadThroughput": -1, "uploadThroughput": -1})
            driver.find_element(By.ID, "later").click()
            page.wait("return !document.getElementById('banner').hidden")
            banner = driver.find_element(By.ID, "banner").text
            assert "Not up to date" in banner and "Nothing is shown for this window" in banner, banner
            assert [] == page.rows()
            assert driver.execute_script("return document.getElementById('banner').getBoundingClientRect().top") < 200
            driver.execute_cdp_cmd("Network.emulateNetworkConditions", {"offline": False, "latency": 0,
                                                                         "downloadThroughput": -1, "uploadThroughput": -1})
            driver.find_element(By.ID, "now").click()
            page.wait("return document.getElementById('banner').hidden && document.querySelectorAll('#rows .row').length > 0")

            # a sign-out while a load is on its way: the load that lands later changes nothing
            driver.execute_cdp_cmd("Network.emulateNetworkConditions", {"offline": False, "latency": 1500,
                                                                         "downloadThroughput": -1, "uploadThroughput": -1})
            driver.find_element(By.ID, "later").click()
            driver.find_element(By.ID, "logout").click()
            driver.execute_cdp_cmd("Network.emulateNetworkConditions", {"offline": False, "latency": 0,
                                                                         "downloadThroughput": -1, "uploadThroughput": -1})
            import time
            time.sleep(2.5)
            assert ("Signed out.", [], True) == (driver.find_element(By.ID, "status").text, page.rows(),
                                                 driver.find_element(By.ID, "board").get_attribute("hidden") is not None)
            # and what it brought is not kept, for whoever signs in next to see
            assert [0, 0] == driver.execute_script("return [state.nodes.length, Object.keys(state.pending).length]")

            # fragments a person may type: empty, or past what a date can be
            for fragment in ("#from=&span=1d", "#from=99999999999999999&span=1d"):
                driver.get(str(api.client.make_url("/ui/")) + fragment)
                driver.execute_script("window.berthErrors = []; window.addEventListener('error', e => "
                                      "window.berthErrors.push(String(e.message)))")
                page.sign_in(ADMIN, "operator")
                shown_from = driver.execute_script("return document.getElementById('range').textContent")
                assert not shown_from.startswith("1970") and not shown_from.startswith("+"), shown_from
                assert [] == driver.execute_script("return window.berthErrors")
                driver.find_element(By.ID, "logout").click()
        finally:
            driver.quit()

    def driven() -> None:
        try:
            drive()
        except StopIteration as e:
            raise AssertionError("an expected element was missing") from e

    await asyncio.wait_for(asyncio.to_thread(driven), 240)
