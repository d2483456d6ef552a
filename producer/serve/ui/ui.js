// The /ui page: polls /ui/state with the API key the person typed (kept in this tab's
// sessionStorage only) and draws three tables. Text goes in with textContent only: error
// messages and ids come from jobs, never as HTML.
"use strict";

const POLL_MS = 2000;
let timer = null;
let busy = false;

const $ = (id) => document.getElementById(id);
const key = () => sessionStorage.getItem("mlxq-key");

function say(text) {
  $("status").textContent = text;
}

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function num(value, digits) {
  if (value === null || value === undefined) return "-";
  return digits === undefined ? String(value) : Number(value).toFixed(digits);
}

function duration(s) {
  if (s === null || s === undefined) return "-";
  if (s < 90) return `${Math.round(s)} s`;
  if (s < 5400) return `${Math.round(s / 60)} min`;
  return `${(s / 3600).toFixed(1)} h`;
}

async function call(method, path) {
  const reply = await fetch(path, {
    method,
    headers: { Authorization: `Bearer ${key()}` },
    cache: "no-store",
  });
  if (reply.status === 401) {
    logout("That API key was refused: enter a valid key.");
    throw new Error("unauthorized");
  }
  const body = await reply.json();
  if (!reply.ok) throw new Error(body.error ? body.error.message : `HTTP ${reply.status}`);
  return body;
}

function cell(row, value, cls) {
  const td = el("td", value, cls);
  row.appendChild(td);
  return td;
}

function action(td, label, batch, run) {
  const b = el("button", label);
  b.type = "button";
  b.setAttribute("aria-label", `${label} ${batch}`);
  b.addEventListener("click", run);
  td.appendChild(b);
}

async function retry(batch) {
  try {
    const obj = await call("POST", `/v1/batches/${encodeURIComponent(batch)}/retry`);
    say(`Batch ${batch}: ${obj.retry.queued} failed job(s) queued again.`);
  } catch (e) {
    if (e.message !== "unauthorized") say(`Batch ${batch}: retry refused: ${e.message}`);
  }
  refresh();
}

async function cancel(batch) {
  if (!window.confirm(`Cancel batch ${batch}? Its queued jobs will not run.`)) return;
  try {
    await call("POST", `/v1/batches/${encodeURIComponent(batch)}/cancel`);
    say(`Batch ${batch}: cancelled.`);
  } catch (e) {
    if (e.message !== "unauthorized") say(`Batch ${batch}: cancel refused: ${e.message}`);
  }
  refresh();
}

function drawBatches(batches) {
  const body = $("batches").tBodies[0];
  const rows = [];
  for (const b of batches) {
    const row = el("tr");
    row.dataset.batch = b.batch_id;
    row.appendChild(el("th", b.batch_id)).scope = "row";
    cell(row, b.state.replace("_", " "), "state");
    const td = cell(row, "");
    const bar = el("progress");
    bar.max = Math.max(b.total, 1);
    bar.value = b.done;
    const pct = b.total ? Math.floor((100 * b.done) / b.total) : 0;
    bar.setAttribute("aria-label", `${b.batch_id} progress`);
    td.append(bar, ` ${b.done}/${b.total} (${pct}%)`);
    for (const n of [b.succeeded, b.failed, b.cancelled, b.queued, b.running]) cell(row, n, "num");
    cell(row, b.rate_per_s === null ? "-" : `${num(b.rate_per_s, 2)} jobs/s`, "num");
    cell(row, b.queued + b.running ? duration(b.eta_s) : "-", "num");
    const acts = cell(row, "");
    const open = b.cancelled_at === null && !["failed", "validating"].includes(b.state);
    if (open && b.failed > 0) action(acts, "Retry failed", b.batch_id, () => retry(b.batch_id));
    if (open && b.state === "in_progress") {
      action(acts, "Cancel", b.batch_id, () => cancel(b.batch_id));
    }
    rows.push(row);
    if (b.errors.length) {
      const er = el("tr", null, "errors");
      const ec = el("td");
      ec.colSpan = 11;
      ec.appendChild(el("span", `First errors of ${b.batch_id}:`));
      const list = el("ul");
      for (const e of b.errors) {
        const item = el("li");
        item.append(el("code", e.custom_id), ` ${e.status_code} `, el("code", e.code), `: ${e.message}`);
        list.appendChild(item);
      }
      ec.appendChild(list);
      er.appendChild(ec);
      rows.push(er);
    }
  }
  if (!rows.length) {
    const row = el("tr");
    cell(row, "No batches in this Redis.").colSpan = 11;
    rows.push(row);
  }
  body.replaceChildren(...rows);
}

function drawWorkers(workers) {
  const rows = workers.map((w) => {
    const row = el("tr");
    row.appendChild(el("th", w.name)).scope = "row";
    cell(row, w.host);
    cell(row, w.state, "state");
    cell(row, (w.models || []).join(", ") || "-");
    cell(row, w.batch_limit ? `${w.batch} of ${w.batch_limit}` : String(w.batch || 0), "num");
    cell(row, w.jobs_done, "num");
    cell(row, num(w.tokens_per_s, 1), "num");
    cell(row, w.acceptance === null || w.acceptance === undefined ? "-" : `${Math.round(100 * w.acceptance)}%`, "num");
    const budget = w.memory_budget_gb ? ` of ${num(w.memory_budget_gb, 1)}` : "";
    cell(row, `${num(w.memory_gb, 2)}${budget} GB`, "num");
    return row;
  });
  if (!rows.length) {
    const row = el("tr");
    cell(row, "No live workers.").colSpan = 9;
    rows.push(row);
  }
  $("workers").tBodies[0].replaceChildren(...rows);
}

function drawQueues(queues) {
  const rows = queues.map((q) => {
    const row = el("tr");
    row.appendChild(el("th", q.name)).scope = "row";
    cell(row, q.depth, "num");
    return row;
  });
  $("queues").tBodies[0].replaceChildren(...rows);
}

async function refresh() {
  if (busy || !key()) return;
  busy = true;
  try {
    const state = await call("GET", "/ui/state");
    drawBatches(state.batches);
    drawWorkers(state.workers);
    drawQueues(state.queues);
    $("scope").textContent = state.tenant === null
      ? "Showing every tenant."
      : `Showing tenant ${state.tenant}'s batches and queues.`;
    $("data").hidden = false;
    $("login").hidden = true;
    document.body.dataset.updated = String(state.at);
    const kept = $("status").textContent;
    if (!kept.startsWith("Batch ")) say(`Updated ${new Date(state.at * 1000).toLocaleTimeString()}.`);
  } catch (e) {
    if (e.message !== "unauthorized") say(`Could not read the fleet: ${e.message}`);
  } finally {
    busy = false;
  }
}

function start() {
  if (timer === null) timer = setInterval(refresh, POLL_MS);
  refresh();
}

function logout(message) {
  sessionStorage.removeItem("mlxq-key");
  clearInterval(timer);
  timer = null;
  $("data").hidden = true;
  $("login").hidden = false;
  for (const id of ["batches", "workers", "queues"]) $(id).tBodies[0].replaceChildren();
  say(message);
  $("key").focus();
}

document.addEventListener("DOMContentLoaded", () => {
  $("login").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem("mlxq-key", $("key").value);
    $("key").value = "";
    say("Reading the fleet...");
    start();
  });
  $("logout").addEventListener("click", () => logout("Key forgotten."));
  if (key()) start();
});
