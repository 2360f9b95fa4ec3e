// promptlb's dashboard: polls the admin status document and draws it. No data is in the page
// itself; the admin token is asked for here, kept in this tab's sessionStorage (gone when the
// tab closes) and sent as an Authorization header: never in a URL, so never in a log.
"use strict";

const TOKEN_KEY = "promptlb-admin-token";
const EVERY_MS = 750; // a poll at most this long after the last answer: under a second behind
const FETCH_MS = 5000; // a status that takes longer is dropped and asked again
const statusUrl = new URL("status", document.baseURI);
let lastAt = 0;
let problem = ""; // why the last poll failed: shown with the age of the data, not in turn with it
let loop = 0; // one polling loop at a time: a new one (after a login) ends the one before

const $ = (id) => document.getElementById(id);

function el(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (className) node.className = className;
  return node;
}

const dash = "\u2013";
const num = (x, digits = 0) => (x === null || x === undefined ? dash : x.toFixed(digits));
const pct = (x, digits = 0) => (x === null || x === undefined ? dash : (x * 100).toFixed(digits) + "%");
function ms(x) {
  if (x === null || x === undefined) return dash;
  return x >= 1000 ? (x / 1000).toFixed(2) + " s" : x.toFixed(0) + " ms";
}
function bytes(x) {
  if (x === null || x === undefined) return dash;
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(x) >= 1024 && i < units.length - 1) { x /= 1024; i++; }
  return x.toFixed(i ? 1 : 0) + " " + units[i];
}

function cell(row, ...lines) {
  const td = el("td");
  lines.forEach((line, i) => {
    if (line instanceof Node) td.append(line);
    else td.append(el("span", line, i ? "sub" : undefined));
  });
  row.append(td);
  return td;
}

function bar(ratio) {
  const outer = el("div", null, "bar");
  const inner = el("span");
  inner.style.width = Math.max(0, Math.min(1, ratio || 0)) * 100 + "%";
  outer.append(inner);
  return outer;
}

function badge(text, kind = text) {
  return el("span", text, "badge state-" + kind);
}

function nodeRow(n) {
  const row = el("tr");
  row.dataset.node = n.name;
  row.dataset.state = n.state;
  row.append(el("td", n.name, "name"));
  const state = cell(row);
  state.className = "state";
  state.append(badge(n.state));
  // The state "leaking" is a node drained before it runs out of memory; this is the status
  // page's earlier warning (fast growth while it still serves), drawn apart from it.
  if (n.leaking && n.state !== "leaking") state.append(badge("memory growing", "growing"));
  if (n.ejected_for_s > 0) state.append(el("span", "back in " + n.ejected_for_s + " s", "sub"));
  // GPU per card
  const gpus = cell(row);
  if (!n.gpus.length) gpus.append(el("span", dash));
  for (const g of n.gpus) {
    gpus.append(el("span", "#" + g.i + " " + pct(g.util) + "  " + bytes(g.mem_used_mib * 1048576) +
      " / " + bytes(g.mem_total_mib * 1048576), "sub"));
    gpus.append(bar(g.util));
  }
  // memory: the host's, and the model server's resident set with its trend
  const slope = n.rss_slope_bytes_per_s;
  cell(row, "host " + pct(n.load.mem),
    "rss " + bytes(n.rss_bytes) + (slope ? " (" + (slope > 0 ? "+" : "") + bytes(slope) + "/s)" : ""));
  const e = n.engine;
  cell(row, e ? e.running + " run / " + e.waiting + " wait" : dash,
    e && e.tps !== null ? num(e.tps) + " tok/s" : "");
  const kv = cell(row, e ? pct(e.kv_cache) : dash);
  if (e && e.kv_cache !== null) kv.append(bar(e.kv_cache));
  cell(row, n.in_flight);
  const lat = n.latency_ms, ttft = n.ttft_ms;
  cell(row, ms(lat.p50) + " / " + ms(lat.p90) + " / " + ms(lat.p99), lat.samples + " answers");
  cell(row, ms(ttft.p50) + " / " + ms(ttft.p90) + " / " + ms(ttft.p99));
  cell(row, pct(n.error_rate, 1),
    n.failures + " of " + n.requests + (n.refusals ? ", " + n.refusals + " refused (4xx)" : ""));
  cell(row, pct(n.share));
  cell(row, num(n.qps, 1));
  return row;
}

function render(doc) {
  const t = doc.totals;
  $("strategy").textContent = "strategy " + doc.strategy;
  $("t-qps").textContent = num(t.qps, 1);
  $("t-tps").textContent = num(t.tokens_per_s);
  $("t-success").textContent = pct(t.success_rate, 1);
  $("t-balance").textContent = num(t.balance_index, 2);
  $("t-ready").textContent = t.nodes_ready + " / " + t.nodes;
  $("t-fallbacks").textContent = t.fallbacks;
  $("t-cache").textContent = t.cache_answers;
  $("t-shed").textContent = t.shed;
  $("window").textContent = t.window_s ? t.window_s.toFixed(0) + " s" : "(first look)";
  $("nodes").tBodies[0].replaceChildren(...doc.nodes.map(nodeRow));
  $("board").hidden = false;
  lastAt = Date.now();
  document.body.dataset.updated = String(lastAt);
}

function askForToken(message) {
  lastAt = 0; // no board, no "last update" ticking over the login
  problem = "";
  $("board").hidden = true;
  $("forget").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = message || "";
  $("freshness").textContent = "";
  $("token").focus();
}

function start() {
  loop += 1;
  poll(loop);
}

// Every way a poll can end schedules the next, or hands over to the login: one that threw
// (a body cut off by a restart, a proxy's HTML error page sent as 200) or never answered
// stopped the board for good, "last update N s ago" until the page was reloaded.
function retry(mine, message) {
  problem = message + "; retrying";
  showFreshness();
  // A way out while it retries: the token may be what fails.
  $("forget").hidden = !sessionStorage.getItem(TOKEN_KEY);
  setTimeout(poll, EVERY_MS, mine);
}

function showFreshness() {
  const age = lastAt ? Date.now() - lastAt : 0;
  const parts = [];
  if (age > 3000) parts.push("last update " + Math.round(age / 1000) + " s ago");
  if (problem) parts.push(problem);
  if (!parts.length) return;
  $("freshness").textContent = parts.join(": ");
  $("freshness").className = "error";
}

async function poll(mine) {
  if (mine !== loop) return;
  const token = sessionStorage.getItem(TOKEN_KEY);
  let headers;
  try {
    headers = new Headers(token ? { Authorization: "Bearer " + token } : {});
  } catch (err) {
    // A pasted character a header cannot carry (a curly quote): every fetch threw, read as
    // "gateway unreachable" for good, with the token kept and no way to forget it.
    sessionStorage.removeItem(TOKEN_KEY);
    return askForToken("That token has characters a header cannot carry.");
  }
  const signal = AbortSignal.timeout(FETCH_MS);
  let response;
  let doc;
  try {
    response = await fetch(statusUrl, { headers, cache: "no-store", credentials: "omit", signal });
  } catch (err) {
    return mine === loop ? retry(mine, "gateway unreachable") : undefined;
  }
  // A login or "Forget token" meanwhile started another loop: this answer is not for it.
  if (mine !== loop) return;
  if (response.status === 401 || response.status === 403) {
    sessionStorage.removeItem(TOKEN_KEY);
    return askForToken(token ? "That token was refused." : "");
  }
  if (!response.ok) return retry(mine, "status answered " + response.status);
  try {
    doc = await response.json();
    if (mine !== loop) return;
    render(doc);
  } catch (err) {
    return retry(mine, "status unreadable (" + err.name + ")");
  }
  $("forget").hidden = !token;
  problem = "";
  $("freshness").className = "muted";
  $("freshness").textContent = "live";
  setTimeout(poll, EVERY_MS, mine);
}

setInterval(showFreshness, 1000);

$("login").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(TOKEN_KEY, $("token").value.trim());
  $("token").value = "";
  $("login").hidden = true;
  start();
});

$("forget").addEventListener("click", () => {
  sessionStorage.removeItem(TOKEN_KEY);
  loop += 1;
  askForToken("");
});

start();
