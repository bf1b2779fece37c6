// Rudder console: a read-only view of the admin API's JSON (docs/operator-guide.md, "Web console").
//
// The token is entered once, kept in this tab's sessionStorage and sent as a bearer header; it
// never goes in a URL. Every value from the API reaches the page as text (textContent, never
// HTML): model names, actors and user agents are the callers' words. The current view is polled
// every second; nothing here writes.
"use strict";
(() => {
  const KEY = "rudder.token";
  const POLL_MS = 1000;
  const VERIFY_MS = 60000; // verifying reads both whole chains: not every poll
  const VIEWS = ["documents", "fleet", "audit"];
  const $ = (id) => document.getElementById(id);

  let view = "documents";
  let selected = null; // {model, kind}
  let timer = null;
  let inflight = false;
  let lastVerify = 0;
  let reconciled = false;
  let auditFilters = {};
  const last = new Map(); // what each table was last drawn from (redraw only on change)
  const seenRouters = new Map(); // router_id -> its last report (kept after it stops reporting)

  // ---- the API ------------------------------------------------------------------------------

  class ApiError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  async function api(method, path, params) {
    const url = new URL(path, window.location.origin);
    for (const [k, v] of Object.entries(params || {})) {
      if (v !== "" && v !== null && v !== undefined) url.searchParams.set(k, String(v));
    }
    const resp = await fetch(url, {
      method,
      headers: { authorization: "Bearer " + sessionStorage.getItem(KEY), accept: "application/json" },
      cache: "no-store",
      credentials: "omit",
    });
    let body = null;
    try {
      // Worker ids are 64-bit: past 2^53 a JavaScript number would round them, so ids are read
      // as strings (an escaped quote inside a JSON string cannot match).
      body = JSON.parse((await resp.text()).replace(/("[a-z_]*id"\s*:\s*)(\d{16,})/g, '$1"$2"'));
    } catch (_) {
      body = null;
    }
    if (!resp.ok) {
      const err = body && body.error ? body.error : {};
      throw new ApiError(resp.status, (err.code ? err.code + ": " : "") + (err.message || "HTTP " + resp.status));
    }
    return body;
  }

  // ---- drawing (text only) ------------------------------------------------------------------

  function fmt(value) {
    if (value === null || value === undefined || value === "") return "-";
    if (typeof value === "boolean") return value ? "yes" : "no";
    if (Array.isArray(value)) return value.length ? value.map(fmt).join(", ") : "-";
    if (typeof value === "object") {
      const entries = Object.entries(value);
      return entries.length ? entries.map(([k, v]) => k + "=" + fmt(v)).join(", ") : "{}";
    }
    return String(value);
  }

  function fmtTime(value) {
    if (!value) return "-";
    const d = new Date(value);
    return Number.isNaN(d.getTime()) ? String(value) : d.toISOString().replace("T", " ").replace(/\.\d+Z$/, "Z");
  }

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === undefined || v === null) continue;
      if (k === "class") node.className = v;
      else node.setAttribute(k, String(v));
    }
    for (const child of children) node.append(child instanceof Node ? child : document.createTextNode(fmt(child)));
    return node;
  }

  function row(cells, attrs) {
    return el("tr", attrs, ...cells.map((c) => (c instanceof Node && c.tagName === "TD" ? c : el("td", {}, c))));
  }

  function fill(tableId, rows, emptyText, columns) {
    const body = $(tableId).tBodies[0];
    if (!rows.length) rows = [row([el("td", { colspan: columns, class: "empty" }, emptyText)])];
    body.replaceChildren(...rows);
  }

  function changed(key, data) {
    const text = JSON.stringify(data);
    if (last.get(key) === text) return false;
    last.set(key, text);
    return true;
  }

  function diffOf(before, after) {
    before = before || {};
    after = after || {};
    const names = [...new Set([...Object.keys(before), ...Object.keys(after)])].sort();
    return names.filter((n) => before[n] !== after[n]).map((n) => [n, before[n], after[n]]);
  }

  function diffCell(before, after) {
    const lines = diffOf(before, after).map(([n, b, a]) =>
      el("div", { class: "change" }, el("span", { class: "param" }, n + ": "),
        el("span", { class: "before" }, fmt(b)), " → ", el("span", { class: "after" }, fmt(a))));
    return el("td", { class: "diff" }, ...(lines.length ? lines : ["no change"]));
  }

  // ---- documents ----------------------------------------------------------------------------

  async function refreshDocuments() {
    const docs = (await api("GET", "/router_policy")).documents || [];
    if (changed("documents", [docs, selected])) {
      fill("documents", docs.map((d) => {
        const routers = d.routers || [];
        const synced = routers.filter((r) => r.in_sync).length;
        const isSelected = selected && selected.model === d.model && selected.kind === d.kind;
        const tr = row([d.model, d.kind, d.revision, d.document, fmtTime(d.updated_at), d.actor,
          synced + "/" + routers.length], { "data-model": d.model, "data-kind": d.kind,
          class: isSelected ? "selected clickable" : "clickable" });
        tr.addEventListener("click", () => {
          selected = { model: d.model, kind: d.kind };
          last.delete("history");
          poll();
        });
        return tr;
      }), "no policy documents (every router runs its startup values)", 7);
    }
    if (!selected) return;
    const doc = docs.find((d) => d.model === selected.model && d.kind === selected.kind);
    const history = await api("GET", "/router_policy/history",
      { model: selected.model, kind: selected.kind, limit: 64 });
    if (!changed("history", [doc, history])) return;
    $("document").hidden = false;
    $("document-title").textContent = selected.model + " " + selected.kind +
      " — revision " + (doc ? doc.revision : 0);
    const overrides = Object.entries((doc && doc.document) || {}).sort();
    fill("overrides", overrides.map(([k, v]) => row([k, v])), "no overrides (startup values)", 2);
    const revs = history.revisions || [];
    fill("history", revs.map((r) => row([r.revision, fmtTime(r.at), r.actor, r.op || r.error, r.changes, r.document],
      { "data-revision": r.revision })), "no history", 6);
    drawRevisionPickers(revs);
  }

  function drawRevisionPickers(revs) {
    const from = $("diff-from");
    const to = $("diff-to");
    const numbers = revs.map((r) => r.revision); // newest first
    const keepFrom = from.value;
    const keepTo = to.value;
    for (const select of [from, to]) {
      select.replaceChildren(el("option", { value: "0" }, "0 (empty)"),
        ...numbers.map((n) => el("option", { value: String(n) }, String(n))));
    }
    const known = (v) => v === "0" || numbers.includes(Number(v));
    const head = numbers.length ? String(numbers[0]) : "0";
    // Follow the head unless the user picked an older one.
    to.value = keepTo && known(keepTo) && keepTo !== last.get("head") ? keepTo : head;
    from.value = keepFrom && known(keepFrom) ? keepFrom : (numbers.length > 1 ? String(numbers[1]) : "0");
    last.set("head", head);
    from.onchange = to.onchange = () => drawRevisionDiff(revs);
    drawRevisionDiff(revs);
  }

  function drawRevisionDiff(revs) {
    const documentAt = (value) => {
      const r = revs.find((x) => String(x.revision) === value);
      return r ? r.document || {} : {};
    };
    const rows = diffOf(documentAt($("diff-from").value), documentAt($("diff-to").value));
    fill("revision-diff", rows.map(([n, b, a]) => row([n, b, a])), "no differences", 3);
  }

  // ---- fleet ---------------------------------------------------------------------------------

  function routerStatus(applied, head) {
    const revision = applied.revision || 0;
    if (applied.last_nack && (applied.last_nack_revision || 0) > revision) {
      return ["nack", "NACK: " + applied.last_nack];
    }
    return revision < head ? ["behind", "behind"] : ["in-sync", "in sync"];
  }

  async function refreshFleet() {
    const [routers, docs, workers] = await Promise.all([
      api("GET", "/routers"), api("GET", "/router_policy"), api("GET", "/workers")]);
    const heads = {};
    for (const d of docs.documents || []) heads[d.model + "|" + d.kind] = d.revision;
    for (const [k, v] of Object.entries(routers.heads || {})) heads[k] = Math.max(heads[k] || 0, v);
    const live = new Set();
    for (const r of routers.routers || []) {
      seenRouters.set(r.router_id, r);
      live.add(r.router_id);
    }
    if (changed("routers", [[...seenRouters.entries()], [...live], heads])) {
      const rows = [];
      for (const [id, r] of [...seenRouters.entries()].sort()) {
        const state = live.has(id) ? "live" : "gone";
        const applied = Object.entries(r.applied || {}).sort();
        if (!applied.length) applied.push(["-", null]);
        for (const [key, a] of applied) {
          const head = heads[key] || 0;
          const [status, text] = a ? routerStatus(a, head) : ["in-sync", "-"];
          rows.push(row([id, state, r.mode, key.replace("|", " "), a ? a.revision : "-", head,
            el("td", { class: "status " + status, "data-status": status }, text), fmtTime(r.heartbeat_at)],
          { "data-router": id, "data-document": key, "data-state": state }));
        }
      }
      fill("routers", rows, "no routers have reported", 8);
    }
    const list = workers.workers || [];
    if (changed("workers", list)) {
      const rows = [];
      for (const w of list) {
        const loads = w.load && w.load.length ? w.load : [{ dp_rank: 0 }];
        for (const l of loads) {
          const total = w.kv_total_blocks || 0;
          const used = l.kv_used_blocks || 0;
          const cache = total ? (100 * used / total).toFixed(1) + "% (" + used + "/" + total + " blocks)" : "-";
          rows.push(row([String(w.instance_id), w.model, w.role, w.engine, l.dp_rank, l.running, l.waiting,
            l.active_prefill_tokens, cache, fmtTime(w.last_seen)], { "data-worker": String(w.instance_id) }));
        }
      }
      fill("workers", rows, "no live workers", 10);
    }
  }

  // ---- audit ---------------------------------------------------------------------------------

  function describeVerify(v) {
    if (v.ok) return ["ok", "intact (" + v.checked + " rows checked)"];
    return ["bad", "BROKEN at row " + fmt(v.first_broken_id) + " (" + fmt(v.chain) + "): " + fmt(v.reason)];
  }

  function describeReconcile(r) {
    if (r.ok) return ["ok", "clean (" + fmt(r.checked_events) + " events, " + fmt(r.checked_decisions) + " decisions)"];
    const kinds = ["events_without_decision", "decisions_without_event", "duplicate_decisions", "bad_signatures",
      "document_mismatches", "reused_msg_ids"];
    const found = kinds.filter((k) => (r[k] || []).length).map((k) => k.replaceAll("_", " ") + ": " + r[k].length);
    return ["bad", "NOT CLEAN — " + found.join("; ")];
  }

  function status(id, [cls, text]) {
    const node = $(id);
    node.className = cls;
    node.textContent = text;
  }

  async function verify() {
    lastVerify = Date.now();
    status("verify-status", ["", "verifying…"]);
    status("verify-status", describeVerify(await api("GET", "/audit/verify")));
  }

  async function reconcile() {
    status("reconcile-status", ["", "running…"]);
    status("reconcile-status", describeReconcile(await api("POST", "/audit/reconcile")));
  }

  async function refreshAudit() {
    let page;
    try {
      page = await api("GET", "/audit", { ...auditFilters, limit: 100 });
    } catch (e) {
      if (e.status === 403) {
        $("audit-denied").textContent = "Your token may not read the audit log (" + e.message +
          "). The auditor and admin roles may.";
        $("audit-denied").hidden = false;
        $("audit-body").hidden = true;
        return;
      }
      throw e;
    }
    $("audit-denied").hidden = true;
    $("audit-body").hidden = false;
    const items = page.items || [];
    if (changed("audit", items)) {
      fill("audit", items.map((a) => {
        // A decision names the revision it made; a received row only the one it expects.
        const revision = fmt(a.expected_revision) + " → " + fmt(a.new_revision);
        const diff = a.after ? diffCell(a.before, a.after) : el("td", { class: "diff" }, fmt(a.changes));
        return row([a.id, fmtTime(a.at), a.stage, a.decision, a.actor, a.model, a.kind, a.op, revision, diff,
          a.reason_code ? a.reason_code + ": " + fmt(a.reason) : "-"],
        { "data-audit-id": a.id, "data-model": a.model, class: "decision-" + (a.decision || "none") });
      }), "no audit records match", 11);
    }
    if (Date.now() - lastVerify > VERIFY_MS) await verify();
    if (!reconciled) {
      reconciled = true;
      await reconcile();
    }
  }

  // ---- the loop, the views, the session ------------------------------------------------------

  const REFRESH = { documents: refreshDocuments, fleet: refreshFleet, audit: refreshAudit };

  async function poll() {
    if (inflight || document.hidden || !sessionStorage.getItem(KEY)) return; // a hidden tab asks nothing
    inflight = true;
    try {
      await REFRESH[view]();
      $("error").textContent = "";
      $("live").className = "ok";
      $("live").title = "updated " + new Date().toISOString();
      document.body.dataset.polls = String(Number(document.body.dataset.polls || 0) + 1);
    } catch (e) {
      if (e.status === 401) {
        logout("the token was refused (" + e.message + ")");
        return;
      }
      $("error").textContent = e.message;
      $("live").className = "stale";
    } finally {
      inflight = false;
    }
  }

  function setView(name) {
    view = VIEWS.includes(name) ? name : "documents";
    for (const section of document.querySelectorAll("main section[data-view]")) {
      section.hidden = section.dataset.view !== view;
    }
    for (const link of document.querySelectorAll("#nav a[data-view]")) {
      link.classList.toggle("active", link.dataset.view === view);
    }
    document.body.dataset.view = view;
    poll();
  }

  function start() {
    $("login").hidden = true;
    $("nav").hidden = false;
    $("main").hidden = false;
    setView(window.location.hash.slice(1));
    if (timer === null) timer = window.setInterval(poll, POLL_MS);
  }

  function logout(message) {
    sessionStorage.removeItem(KEY);
    if (timer !== null) window.clearInterval(timer);
    timer = null;
    last.clear();
    seenRouters.clear();
    selected = null;
    $("document").hidden = true;
    reconciled = false;
    lastVerify = 0;
    $("nav").hidden = true;
    $("main").hidden = true;
    $("login").hidden = false;
    $("login-error").textContent = message || "";
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("login-form").addEventListener("submit", async (event) => {
      event.preventDefault();
      const value = $("token").value.trim();
      $("token").value = "";
      sessionStorage.setItem(KEY, value);
      try {
        await api("GET", "/router_policy");
        start();
      } catch (e) {
        logout(e.status === 401 ? "unknown or revoked token" : e.message);
      }
    });
    $("logout").addEventListener("click", () => logout(""));
    $("verify").addEventListener("click", () => verify().catch((e) => status("verify-status", ["bad", e.message])));
    $("reconcile").addEventListener("click", () => reconcile().catch((e) => status("reconcile-status", ["bad", e.message])));
    $("audit-filters").addEventListener("submit", (event) => {
      event.preventDefault();
      auditFilters = Object.fromEntries(new FormData(event.target).entries());
      last.delete("audit");
      poll();
    });
    window.addEventListener("hashchange", () => setView(window.location.hash.slice(1)));
    document.addEventListener("visibilitychange", () => poll());
    if (sessionStorage.getItem(KEY)) start();
    else logout("");
  });
})();
