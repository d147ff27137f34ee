// Berth's calendar page: a read-only timeline of bookings, from the same API the CLI uses.
//
// Operators (the admin token or an operator principal's) see every node of the fleet they may read, a row per
// node and per GPU, each booking a bar. A tenant's token shows that tenant's own reservations, on the nodes and
// GPUs they hold, and each offered pool's free devices over time. The token lives in sessionStorage only: it is
// sent in the Authorization header, never in a URL. The view (where and how wide) lives in the URL's fragment:
// #from=<epoch ms>&span=<6h|12h|1d|3d|7d|14d|28d>. Every text from the API goes into the page as text, never as
// markup.
"use strict";

const HOUR = 3600e3;
const DAY = 24 * HOUR;
const SPANS = [["6h", 6 * HOUR], ["12h", 12 * HOUR], ["1d", DAY], ["3d", 3 * DAY], ["7d", 7 * DAY],
               ["14d", 14 * DAY], ["28d", 28 * DAY]];
const DEFAULT_SPAN = "3d";
const REFRESH_MS = 30e3;
const TOKEN_KEY = "berth.token";
const VIEW_KEY = "berth.view";
const LIVE = new Set(["pending", "placed", "binding", "active"]);
const MAX_TIME = 32503680000000;  // the year 3000, the API's bound for times
const LIST_PAGES = 100;  // per live state: 20,000 reservations

const $ = (id) => document.getElementById(id);
const state = {
  token: sessionStorage.getItem(TOKEN_KEY),
  view: sessionStorage.getItem(VIEW_KEY),  // "operator" or "tenant", found at sign-in
  span: DEFAULT_SPAN,
  from: null,  // the left edge, epoch ms; null: a little before now
  skew: 0,  // the server's clock less this browser's, from the answers' `now`
  nodes: [], reservations: [], pools: [],
  pending: {},  // operators: each pool's reservations not placed yet (they hold no node, so no bar)
  loaded: null,  // [from, until] of the window the data on the page was loaded for
  failed: false,  // the last load failed
  loading: null,
};

// ---- the API ---------------------------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, code, message) { super(message); this.status = status; this.code = code; }
}

async function post(path, body) {
  const resp = await fetch(path, {
    method: "POST", cache: "no-store", credentials: "omit", referrerPolicy: "no-referrer",
    headers: {"Content-Type": "application/json", "Authorization": "Bearer " + state.token},
    body: JSON.stringify(body || {}),
  });
  let doc = {};
  try { doc = await resp.json(); } catch (e) { /* not JSON: the status says enough */ }
  if (!resp.ok) {
    const err = doc.error || {};
    throw new ApiError(resp.status, err.code || "HTTP_" + resp.status, err.message || resp.statusText);
  }
  if (typeof doc.now === "number") state.skew = doc.now - Date.now();
  return doc;
}

const now = () => Date.now() + state.skew;
const spanMs = () => SPANS.find(([k]) => k === state.span)[1];
const viewFrom = () => state.from !== null ? state.from : Math.floor((now() - spanMs() * 0.1) / 60e3) * 60e3;
const viewUntil = () => viewFrom() + spanMs();

// ---- times -----------------------------------------------------------------------------------------------------

const pad = (n) => String(n).padStart(2, "0");
const WEEKDAYS = ["Sun", "Mon", "Tue", "Wed", "Thu", "Fri", "Sat"];
const MONTHS = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"];
function iso(ms) { return new Date(ms).toISOString().replace(".000Z", "Z"); }
function clock(ms) { const d = new Date(ms); return pad(d.getUTCHours()) + ":" + pad(d.getUTCMinutes()); }
function day(ms) { const d = new Date(ms); return WEEKDAYS[d.getUTCDay()] + " " + d.getUTCDate() + " " + MONTHS[d.getUTCMonth()]; }

const STEPS = [HOUR, 2 * HOUR, 3 * HOUR, 6 * HOUR, 12 * HOUR, DAY, 2 * DAY, 4 * DAY, 7 * DAY];
const TICK_PX = 64;  // the widest label ("Mon 17 Dec") with room to spare

// The finest step whose ticks are at least a label apart on a track `width` pixels wide.
function tickStep(span, width) {
  const perPx = span / Math.max(1, width);
  return STEPS.find((step) => step / perPx >= TICK_PX) || STEPS[STEPS.length - 1];
}

// ---- the fragment (the view, never the token) -----------------------------------------------------------------

function readHash() {
  const params = new URLSearchParams(location.hash.slice(1));
  const span = params.get("span");
  if (span && SPANS.some(([k]) => k === span)) state.span = span;
  const from = Number(params.get("from"));  // a time the page can draw (a hand-edited one may not be)
  state.from = params.get("from") && Number.isFinite(from) && from > 0 && from < MAX_TIME ? from : null;
}

function writeHash() {
  const params = new URLSearchParams();
  if (state.from !== null) params.set("from", String(state.from));
  params.set("span", state.span);
  history.replaceState(null, "", "#" + params.toString());
}

// ---- drawing ---------------------------------------------------------------------------------------------------

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

// Where [start, end) falls in the view, as fractions of the track; null when it is not in view.
function place(start, end) {
  const from = viewFrom(), span = spanMs();
  const a = (start - from) / span, b = (end - from) / span;
  if (b <= 0 || a >= 1) return null;
  return {left: Math.max(0, a), right: Math.min(1, b), clipLeft: a < 0, clipRight: b > 1};
}

function position(e, p) {
  e.style.left = (p.left * 100).toFixed(4) + "%";
  e.style.width = ((p.right - p.left) * 100).toFixed(4) + "%";
}

// Greedy lanes: overlapping bars in one row (slots, MIG instances, a node's many GPUs) go one above the other.
function lanes(items) {
  const ends = [];
  const out = items.slice().sort((x, y) => x.start - y.start).map((item) => {
    let lane = ends.findIndex((e) => e <= item.start);
    if (lane < 0) { lane = ends.length; ends.push(0); }
    ends[lane] = item.end;
    return {item, lane};
  });
  return {placed: out, count: Math.max(1, ends.length)};
}

function bar(b) {
  const p = place(b.start, b.end);
  if (!p) return null;
  const e = el("div", "bar state-" + b.state);
  if (b.spot) e.classList.add("spot");
  if (b.carriedOn) e.classList.add("carried-on");
  if (p.clipLeft) e.classList.add("clip-left");
  if (p.clipRight) e.classList.add("clip-right");
  position(e, p);
  let label = b.tenantId + " · " + b.state + " · " + b.binding;
  if (b.spot) label += " · spot";
  if (b.carriedOn) label += " · carried on";
  e.textContent = label;
  e.title = b.reservationId + "\n" + label + "\n" + iso(b.start) + " – " + iso(b.end) +
    (b.devices && b.devices.length ? "\n" + b.devices.join(", ") : "");
  e.tabIndex = 0;  // reachable by keyboard; a screen reader reads what the tooltip shows
  e.setAttribute("role", "img");
  e.setAttribute("aria-label", e.title.replace(/\n/g, ", "));
  Object.assign(e.dataset, {reservation: b.reservationId, tenant: b.tenantId, state: b.state, binding: b.binding,
                            spot: String(!!b.spot), carriedOn: String(!!b.carriedOn), start: String(b.start),
                            end: String(b.end)});
  return e;
}

function row(kind, key, labelNodes, bars, extraClass) {
  const r = el("div", "row " + kind + (extraClass ? " " + extraClass : ""));
  r.dataset.row = key;
  r.dataset.kind = kind;
  const label = el("div", "label");
  for (const n of labelNodes) label.append(n);
  label.title = label.textContent;
  const track = el("div", "track");
  const {placed, count} = lanes(bars);
  r.style.minHeight = "calc(var(--row) * " + Math.min(count, 4) + ")";
  for (const {item, lane} of placed) {
    const e = bar(item);
    if (!e) continue;
    e.style.top = "calc(" + (100 * lane / count).toFixed(3) + "% + 2px)";
    e.style.height = "calc(" + (100 / count).toFixed(3) + "% - 4px)";
    e.dataset.row = key;
    track.append(e);
  }
  r.append(label, track);
  return r;
}

function badge(text) { return el("span", "badge " + text, text); }

function drawAxis() {
  const ticks = $("ticks");
  ticks.replaceChildren();
  const from = viewFrom(), until = viewUntil(), step = tickStep(spanMs(), ticks.clientWidth || 800);
  for (let t = Math.ceil(from / step) * step; t < until; t += step) {
    const midnight = t % DAY === 0;
    const text = step >= DAY ? day(t) : (midnight ? day(t) : clock(t));
    const tick = el("div", "tick" + (midnight ? " major" : ""), text);
    tick.style.left = ((t - from) / spanMs() * 100).toFixed(4) + "%";
    tick.dataset.at = String(t);
    ticks.append(tick);
  }
  $("range").textContent = iso(from) + " – " + iso(until) + " (UTC)";
}

function drawCursor() {
  const f = (now() - viewFrom()) / spanMs();
  const cursor = $("cursor");
  cursor.hidden = !(f >= 0 && f <= 1);
  cursor.style.left = "calc(var(--label) + (100% - var(--label)) * " + f.toFixed(6) + ")";
  cursor.dataset.at = String(now());
}

function drawOperator(rows) {
  const pool = $("pool").value;
  const showGpus = $("show-gpus").checked;
  let lastPool = null;
  for (const n of state.nodes) {
    if (pool && n.poolId !== pool) continue;
    if (n.poolId !== lastPool) {
      lastPool = n.poolId;
      const head = el("div", "row pool-head");
      head.dataset.row = "pool:" + n.poolId;
      const pending = state.pending[n.poolId] || 0;
      head.append(el("div", "label", "pool " + n.poolId + (pending ? " · " + pending + " pending (not placed yet)" : "")));
      head.dataset.pending = String(pending);
      rows.append(head);
    }
    const inv = n.inventory;
    const name = el("span", "", n.id);
    const meta = el("span", "", " " + inv.gpus + " GPU");
    meta.className = "meta";
    const unavailable = n.state !== "ready" ? "unavailable" : "";
    const r = row("node", n.id, [name, badge(n.state), meta], n.bookings, unavailable);
    r.dataset.state = n.state;
    r.querySelector(".label").title = n.id + " (" + n.hostname + "), " + n.state +
      (n.lastHeartbeat ? ", last heartbeat " + n.lastHeartbeat : ", no heartbeat yet");
    rows.append(r);
    if (!showGpus) continue;
    for (const g of inv.gpuIndices) {
      const on = n.bookings.filter((b) => b.gpus.includes(g));
      rows.append(row("gpu", n.id + "/gpu" + g, [el("span", "", "gpu " + g)], on, unavailable));
    }
  }
}

function gpuOf(device) {
  const m = /^gpu(\d+)/.exec(device);
  return m ? Number(m[1]) : null;
}

function asBooking(r, start, end, devices) {
  return {reservationId: r.id, tenantId: r.tenantId, state: r.state, binding: r.binding, spot: r.spot,
          carriedOn: (r.conditions || []).some((c) => c.type === "DevicesHeld" && c.status === "True"),
          start, end, devices};
}

function drawTenant(rows) {
  const t = now();
  const live = state.reservations.filter((r) => LIVE.has(r.state));
  for (const p of state.pools) {
    const head = el("div", "row pool-head");
    head.dataset.row = "pool:" + p.id;
    head.append(el("div", "label", "pool " + p.id + " · " + p.gpuModel + " · " + p.region));
    rows.append(head);
    // Free devices over time: one step per change.
    const free = el("div", "row free");
    free.dataset.row = "free:" + p.id;
    free.dataset.kind = "free";
    free.append(el("div", "label", "free of " + p.units));
    const track = el("div", "track");
    p.free.forEach((s, i) => {
      const end = i + 1 < p.free.length ? p.free[i + 1].at : viewUntil();
      const where = place(s.at, end);
      if (!where) return;
      const e = el("div", "free-step" + (s.units === 0 ? " none" : ""), s.units + " free");
      position(e, where);
      e.style.opacity = s.units === 0 ? "1" : String(0.35 + 0.65 * s.units / Math.max(1, p.units));
      Object.assign(e.dataset, {units: String(s.units), at: String(s.at), end: String(end)});
      e.title = s.units + " of " + p.units + " devices free from " + iso(s.at);
      track.append(e);
    });
    free.append(track);
    rows.append(free);
    // The tenant's own reservations of this pool, on the nodes and GPUs they hold.
    const mine = live.filter((r) => r.poolId === p.id);
    const byNode = new Map();
    const unplaced = [];
    for (const r of mine) {
      const start = r.start !== null && r.start !== undefined ? r.start : t;
      const end = r.end !== null && r.end !== undefined ? r.end : start + (r.durationHours || 0) * HOUR;
      if (!r.placements || r.placements.length === 0) { unplaced.push(asBooking(r, start, end, [])); continue; }
      for (const pl of r.placements) {
        if (!byNode.has(pl.nodeId)) byNode.set(pl.nodeId, new Map());
        const gpus = byNode.get(pl.nodeId);
        const b = asBooking(r, start, end, pl.devices);
        for (const g of new Set(pl.devices.map(gpuOf).filter((g) => g !== null))) {
          if (!gpus.has(g)) gpus.set(g, []);
          gpus.get(g).push(b);
        }
        if (!gpus.has("all")) gpus.set("all", []);
        gpus.get("all").push(b);
      }
    }
    for (const nodeId of [...byNode.keys()].sort()) {
      const gpus = byNode.get(nodeId);
      rows.append(row("node", nodeId, [el("span", "", nodeId)], gpus.get("all")));
      for (const g of [...gpus.keys()].filter((k) => k !== "all").sort((a, b) => a - b)) {
        rows.append(row("gpu", nodeId + "/gpu" + g, [el("span", "", "gpu " + g)], gpus.get(g)));
      }
    }
    if (unplaced.length) rows.append(row("unplaced", "unplaced:" + p.id, [el("span", "", "not placed yet")], unplaced));
  }
}

function draw() {
  drawAxis();
  const rows = $("rows");
  const fresh = document.createDocumentFragment();
  // A window never loaded, whose load failed, shows nothing (a redraw for the pool filter or "GPUs" included).
  if (!(state.failed && !covered())) {
    if (state.view === "operator") drawOperator(fresh); else drawTenant(fresh);
  }
  rows.replaceChildren(fresh);
  $("board").classList.toggle("unloaded", !covered());  // dimmed until this window's load lands
  $("span").value = state.span;
  drawCursor();
  document.body.dataset.view = state.view || "";
  document.body.dataset.ready = "true";
}

// ---- loading ---------------------------------------------------------------------------------------------------

// Whether the data on the page was loaded for the window in view (a pan or a zoom draws before its load lands).
function covered() {
  if (state.loaded === null) return false;
  const [a, b] = state.loaded;
  const slack = state.from === null ? spanMs() * 0.1 : 0;  // at "now" the view moves on by itself, a minute at a time
  return b - a === spanMs() && a <= viewFrom() + slack && viewUntil() <= b + slack;
}

function stale(text) {
  const b = $("banner");
  b.hidden = !text;
  b.textContent = text || "";
}

function say(text, error) {
  const s = $("status");
  s.textContent = text;
  s.classList.toggle("error", !!error);
  if (!error) s.dataset.at = iso(now());
}

// The loaders fetch and return what they found, and `keep` puts it in the page's state: load() calls that only
// once it knows no sign-out or newer load overtook this one, so what a dropped load brings is never drawn.
async function loadOperator() {
  const [doc, fleet] = await Promise.all([post("/api/admin/nodes/list", {from: viewFrom(), until: viewUntil()}),
                                          post("/api/admin/pools/list", {})]);
  return {summary: doc.nodes.length + " nodes", keep: () => keepOperator(doc, fleet)};
}

function keepOperator(doc, fleet) {
  state.nodes = doc.nodes;
  state.pending = Object.fromEntries(fleet.pools.map((p) => [p.id, p.pending || 0]));
  const select = $("pool");
  const chosen = select.value;
  const pools = [...new Set(doc.nodes.map((n) => n.poolId))].sort();
  select.replaceChildren(el("option", "", "all"));
  select.firstChild.value = "";
  for (const p of pools) { const o = el("option", "", p); o.value = p; select.append(o); }
  select.value = pools.includes(chosen) ? chosen : "";
}

async function loadTenant() {
  const [pools, reservations] = await Promise.all([
    post("/api/compute/pools/list", {from: viewFrom(), until: viewUntil()}),
    // Every live reservation, state by state: ended ones (however many) hold nothing and are not drawn.
    Promise.all([...LIVE].map(async (st) => {
      const all = [];
      let cursor = null;
      for (let page = 0; page < LIST_PAGES; page++) {
        const body = {scope: "all", state: st, limit: 200};
        if (cursor) body.cursor = cursor;
        const doc = await post("/api/compute/reservations/list", body);
        all.push(...doc.reservations);
        if (!doc.nextCursor) break;
        cursor = doc.nextCursor;
      }
      return all;
    // one that moved on between the states' pages may come twice: once, as its later listing has it
    })).then((lists) => [...new Map(lists.flat().map((r) => [r.id, r])).values()]),
  ]);
  return {summary: reservations.length + " live reservations",
          keep: () => { state.pools = pools.pools; state.reservations = reservations; }};
}

async function load() {
  if (!state.token || !state.view) return;
  const mine = {};
  state.loading = mine;
  const asked = [viewFrom(), viewUntil()];
  try {
    const {summary, keep} = state.view === "operator" ? await loadOperator() : await loadTenant();
    if (state.loading !== mine) return;  // a newer load, or a sign-out, overtook this one: its data is dropped
    keep();
    state.loaded = asked;
    state.failed = false;
    stale(null);
    draw();
    say((state.view === "operator" ? "operator view" : "tenant view") + " · " + summary + " · updated " +
        iso(now()));
  } catch (err) {
    if (state.loading !== mine) return;
    if (err instanceof ApiError && err.status === 401) { signOut(); say("Sign in: " + err.message, true); return; }
    const why = err instanceof ApiError ? err.message : "the control plane cannot be reached (" + (err.message || err) + ")";
    state.failed = true;
    if (!covered()) $("rows").replaceChildren();  // never loaded for this window: nothing to show as if it were
    stale("Not up to date: " + why + ". " + (covered() ? "The bookings shown were loaded at " + $("status").dataset.at + "."
                                                       : "Nothing is shown for this window.") +
          " Trying again every " + REFRESH_MS / 1e3 + " s.");
    say(why, true);
  } finally {
    if (state.loading === mine) state.loading = null;
  }
}

// Which view a token opens: whoami answers a tenant's token (so a tenant's sign-in asks nothing that fails, and
// its console stays clean); it refuses the admin token and an operator's with 403, which the admin API answers;
// an unknown token is 401 there, and shown.
async function detectView() {
  try {
    await post("/api/iam/whoami", {});
    return "tenant";
  } catch (err) {
    if (!(err instanceof ApiError) || err.status !== 403) throw err;
  }
  await post("/api/admin/pools/list", {});
  return "operator";
}

function showSignedIn(on) {
  $("login").hidden = on;
  $("who").hidden = !on;
  $("controls").hidden = !on;
  $("board").hidden = !on;
  $("legend").hidden = !on;
  for (const e of document.querySelectorAll(".operator-only")) e.hidden = !on || state.view !== "operator";
  $("identity").textContent = on ? (state.view === "operator" ? "operator" : "tenant") : "";
}

async function signIn(token) {
  state.token = token;
  try {
    state.view = await detectView();
  } catch (err) {
    state.token = null;
    // (the API's own message speaks of the tenant API the check asked: this page takes operator tokens too)
    say(err instanceof ApiError && err.status === 401
        ? "This token is not accepted: it is no tenant principal's, no operator's and not the admin token. " +
          "Check it (a character missing or added when it was copied?)"
        : (err.message || String(err)), true);
    return;
  }
  sessionStorage.setItem(TOKEN_KEY, token);
  sessionStorage.setItem(VIEW_KEY, state.view);
  showSignedIn(true);
  await load();
}

function signOut() {
  sessionStorage.removeItem(TOKEN_KEY);
  sessionStorage.removeItem(VIEW_KEY);
  state.token = state.view = null;
  state.loading = state.loaded = null;  // a load in flight is dropped when it lands
  state.failed = false;
  state.nodes = state.reservations = state.pools = [];
  state.pending = {};
  stale(null);
  $("rows").replaceChildren();
  showSignedIn(false);
}

// ---- moving the view -------------------------------------------------------------------------------------------

function zoom(by) {
  const i = SPANS.findIndex(([k]) => k === state.span);
  const j = Math.max(0, Math.min(SPANS.length - 1, i + by));
  if (j === i) return;
  const centre = viewFrom() + spanMs() / 2;
  state.span = SPANS[j][0];
  if (state.from !== null) state.from = Math.round(centre - spanMs() / 2);
  changed();
}

function pan(by) {
  state.from = Math.round(viewFrom() + by * spanMs() / 2);
  changed();
}

function changed() {
  writeHash();
  draw();  // at once with what is loaded, then with the new window's bookings
  load();
}

function init() {
  const span = $("span");
  for (const [k] of SPANS) { const o = el("option", "", k); o.value = k; span.append(o); }
  readHash();
  span.value = state.span;
  span.addEventListener("change", () => {
    const centre = viewFrom() + spanMs() / 2;
    state.span = span.value;
    if (state.from !== null) state.from = Math.round(centre - spanMs() / 2);
    changed();
  });
  $("zoom-in").addEventListener("click", () => zoom(-1));
  $("zoom-out").addEventListener("click", () => zoom(1));
  $("earlier").addEventListener("click", () => pan(-1));
  $("later").addEventListener("click", () => pan(1));
  $("now").addEventListener("click", () => { state.from = null; changed(); });
  $("show-gpus").addEventListener("change", draw);
  $("pool").addEventListener("change", draw);
  $("logout").addEventListener("click", () => { signOut(); say("Signed out."); });
  $("login").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const input = $("token");
    const token = input.value.trim();
    input.value = "";
    if (token) signIn(token);
  });
  document.addEventListener("keydown", (ev) => {
    // The browser's keys (Ctrl/Cmd zoom, Alt+arrow history) and the controls' own keys are theirs.
    if (ev.ctrlKey || ev.metaKey || ev.altKey || !state.view) return;
    const t = ev.target;
    if (t instanceof HTMLSelectElement || t instanceof HTMLTextAreaElement ||
        (t instanceof HTMLInputElement && t.type !== "checkbox")) return;
    if (ev.key === "+" || ev.key === "=") zoom(-1);
    else if (ev.key === "-") zoom(1);
    else if (ev.key === "ArrowLeft") pan(-1);
    else if (ev.key === "ArrowRight") pan(1);
  });
  window.addEventListener("hashchange", () => { readHash(); draw(); load(); });
  setInterval(drawCursor, 5e3);
  setInterval(load, REFRESH_MS);
  if (state.token && state.view) { showSignedIn(true); load(); } else { showSignedIn(false); }
}

document.addEventListener("DOMContentLoaded", init);
