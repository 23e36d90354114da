// radixserve web console: playground, dashboard, radix tree view. Plain JS, no build step.
// Model output is never inserted as HTML: the markdown renderer escapes every character of
// it first and only adds its own tags; everything else goes through textContent.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const KEY_STORE = "radixserve-api-key";
  let apiKey = sessionStorage.getItem(KEY_STORE) || "";

  // -- API --------------------------------------------------------------------------------
  function headers(json) {
    const h = {};
    if (json) h["Content-Type"] = "application/json";
    if (apiKey) h.Authorization = "Bearer " + apiKey;
    return h;
  }

  async function api(path, opts = {}) {
    const r = await fetch(path, { ...opts, headers: headers(Boolean(opts.body)) });
    if (r.status === 401) {
      $("key-form").hidden = false;
      throw new Error("this server needs an API key (enter it at the top right)");
    }
    return r;
  }

  async function errorMessage(r) {
    try {
      const body = await r.json();
      return (body.error && body.error.message) || r.statusText;
    } catch (_) {
      return r.status + " " + r.statusText;
    }
  }

  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    apiKey = $("api-key").value.trim();
    sessionStorage.setItem(KEY_STORE, apiKey);
    $("key-form").hidden = true;
    pollStats();
  });

  // -- tabs -------------------------------------------------------------------------------
  const TABS = ["playground", "dashboard", "radix"];
  let radixLoaded = false;
  function showTab() {
    let name = location.hash.slice(1);
    if (!TABS.includes(name)) name = "playground";
    for (const t of TABS) $(t).hidden = t !== name;
    for (const a of document.querySelectorAll("nav a")) {
      a.classList.toggle("active", a.dataset.tab === name);
    }
    if (name === "dashboard") drawCharts();
    if (name === "radix" && !radixLoaded) refreshRadix();
  }
  window.addEventListener("hashchange", showTab);

  // -- markdown (escaped) -------------------------------------------------------------------
  function escapeHtml(s) {
    return s
      .replace(/&/g, "&amp;")
      .replace(/</g, "&lt;")
      .replace(/>/g, "&gt;")
      .replace(/"/g, "&quot;")
      .replace(/'/g, "&#39;");
  }

  function inline(raw) {
    // code spans first (their content is left alone), then bold and italics
    const codes = [];
    let s = escapeHtml(raw.replace(/\u0000/g, "")).replace(/`([^`]+)`/g, (_, c) => {
      codes.push(c);
      return "\u0000" + (codes.length - 1) + "\u0000";
    });
    s = s.replace(/\*\*([^*]+)\*\*/g, "<strong>$1</strong>");
    s = s.replace(/(^|[^*])\*([^*\s][^*]*)\*/g, "$1<em>$2</em>");
    return s.replace(/\u0000(\d+)\u0000/g, (_, i) => "<code>" + codes[Number(i)] + "</code>");
  }

  function renderMarkdown(text) {
    const out = [];
    const lines = text.split("\n");
    let para = [];
    let list = null; // {tag, items}
    const flush = () => {
      if (para.length) out.push("<p>" + para.map(inline).join("<br>") + "</p>");
      para = [];
      if (list) {
        out.push("<" + list.tag + ">" + list.items.map((x) => "<li>" + inline(x) + "</li>").join("") + "</" + list.tag + ">");
      }
      list = null;
    };
    for (let i = 0; i < lines.length; i++) {
      const line = lines[i];
      let m;
      if (/^\s*```/.test(line)) {
        flush();
        const code = [];
        for (i++; i < lines.length && !/^\s*```/.test(lines[i]); i++) code.push(lines[i]);
        out.push("<pre><code>" + escapeHtml(code.join("\n")) + "</code></pre>");
      } else if ((m = /^(#{1,6})\s+(.*)$/.exec(line))) {
        flush();
        const n = m[1].length;
        out.push("<h" + n + ">" + inline(m[2]) + "</h" + n + ">");
      } else if ((m = /^\s*[-*+]\s+(.*)$/.exec(line)) || (m = /^\s*\d+[.)]\s+(.*)$/.exec(line))) {
        const tag = /^\s*\d/.test(line) ? "ol" : "ul";
        if (para.length || (list && list.tag !== tag)) flush();
        if (!list) list = { tag, items: [] };
        list.items.push(m[1]);
      } else if (!line.trim()) {
        flush();
      } else {
        if (list) flush();
        para.push(line);
      }
    }
    flush();
    return out.join("");
  }

  // -- playground ---------------------------------------------------------------------------
  const chat = []; // {role, content, el}
  let controller = null;

  for (const [id, out] of [["temperature", "temperature-value"], ["top-p", "top-p-value"]]) {
    $(id).addEventListener("input", () => ($(out).textContent = $(id).value));
  }

  function addMessage(role, content) {
    const el = document.createElement("div");
    el.className = "msg " + role;
    const r = document.createElement("div");
    r.className = "role";
    r.textContent = role;
    const c = document.createElement("div");
    c.className = "content";
    const readout = document.createElement("div");
    readout.className = "readout";
    el.append(r, c, readout);
    $("messages").append(el);
    const msg = { role, content, el };
    renderContent(msg);
    chat.push(msg);
    return msg;
  }

  function renderContent(msg) {
    if (msg.reasoning) {
      // the model's thinking (--reasoning-parser): folded above the answer, as plain text
      let box = msg.el.querySelector("details.thinking");
      if (!box) {
        box = document.createElement("details");
        box.className = "thinking";
        const summary = document.createElement("summary");
        summary.textContent = "Thinking";
        const text = document.createElement("div");
        text.className = "thinking-text";
        box.append(summary, text);
        msg.el.querySelector(".content").before(box);
      }
      box.querySelector(".thinking-text").textContent = msg.reasoning;
    }
    msg.el.querySelector(".content").innerHTML = renderMarkdown(msg.content);
    const box = $("messages");
    box.scrollTop = box.scrollHeight;
  }

  function setBusy(busy) {
    $("send").disabled = busy;
    $("stop").disabled = !busy;
    $("regenerate").disabled = busy || !chat.some((m) => m.role === "assistant");
  }

  function requestMessages() {
    const msgs = [];
    const system = $("system-prompt").value;
    if (system.trim()) msgs.push({ role: "system", content: system });
    for (const m of chat) msgs.push({ role: m.role, content: m.content });
    return msgs;
  }

  function readout(msg, parts) {
    const box = msg.el.querySelector(".readout");
    box.replaceChildren();
    for (const [cls, label, value] of parts) {
      const s = document.createElement("span");
      s.className = cls;
      s.dataset.value = String(value);
      s.textContent = label + " " + value;
      box.append(s);
    }
  }

  async function generate() {
    const messages = requestMessages();
    const msg = addMessage("assistant", "");
    msg.el.dataset.state = "streaming";
    const body = {
      messages,
      stream: true,
      stream_options: { include_usage: true },
      temperature: Number($("temperature").value),
      top_p: Number($("top-p").value),
      max_tokens: Number($("max-tokens").value) || undefined,
      model: $("model-picker").value || undefined,
    };
    controller = new AbortController();
    setBusy(true);
    const t0 = performance.now();
    let tFirst = null;
    let chunks = 0;
    let usage = null;
    let finish = null;
    let pending = false;
    const render = () => {
      if (pending) return;
      pending = true;
      requestAnimationFrame(() => {
        pending = false;
        renderContent(msg);
      });
    };
    try {
      const r = await api("/v1/chat/completions", {
        method: "POST",
        body: JSON.stringify(body),
        signal: controller.signal,
      });
      if (!r.ok) throw new Error(await errorMessage(r));
      const reader = r.body.getReader();
      const decoder = new TextDecoder();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += decoder.decode(value, { stream: true });
        let k;
        while ((k = buf.indexOf("\n\n")) >= 0) {
          const frame = buf.slice(0, k);
          buf = buf.slice(k + 2);
          for (const line of frame.split("\n")) {
            if (!line.startsWith("data: ")) continue;
            const data = line.slice(6);
            if (data === "[DONE]") continue;
            const obj = JSON.parse(data);
            if (obj.error) throw new Error(obj.error.message);
            if (obj.usage) usage = obj.usage;
            for (const c of obj.choices || []) {
              if (c.delta && c.delta.reasoning_content) {
                if (tFirst === null) tFirst = performance.now();
                msg.reasoning = (msg.reasoning || "") + c.delta.reasoning_content;
                render();
              }
              if (c.delta && c.delta.content) {
                if (tFirst === null) tFirst = performance.now();
                msg.content += c.delta.content;
                chunks++;
                render();
              }
              if (c.finish_reason) finish = c.finish_reason;
            }
          }
        }
      }
      msg.el.dataset.state = "done";
    } catch (e) {
      if (e.name === "AbortError") {
        msg.el.dataset.state = "stopped";
        finish = "stopped";
      } else {
        msg.el.dataset.state = "error";
        const err = document.createElement("div");
        err.className = "error";
        err.textContent = e.message;
        msg.el.append(err);
      }
    } finally {
      controller = null;
      renderContent(msg);
      const tEnd = performance.now();
      const tokens = usage ? usage.completion_tokens : chunks;
      const parts = [];
      if (tFirst !== null) {
        parts.push(["ttft", "TTFT", ((tFirst - t0) / 1000).toFixed(3) + " s"]);
        const decodeS = (tEnd - tFirst) / 1000;
        if (tokens > 1 && decodeS > 0) parts.push(["tps", "tok/s", ((tokens - 1) / decodeS).toFixed(1)]);
      }
      parts.push(["tokens", "tokens", tokens]);
      if (usage) {
        parts.push(["prompt", "prompt", usage.prompt_tokens]);
        const cached = usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : 0;
        parts.push(["cached", "cached", cached]);
      }
      parts.push(["finish", "finish", finish || "?"]);
      readout(msg, parts);
      setBusy(false);
    }
  }

  $("chat-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    if (controller) return;
    const text = $("user-input").value;
    if (!text.trim()) return;
    $("user-input").value = "";
    addMessage("user", text);
    generate();
  });
  $("user-input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) {
      ev.preventDefault();
      $("chat-form").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => controller && controller.abort());
  $("regenerate").addEventListener("click", () => {
    if (controller) return;
    const last = chat[chat.length - 1];
    if (!last || last.role !== "assistant") return;
    chat.pop();
    last.el.remove();
    generate();
  });
  $("clear-chat").addEventListener("click", () => {
    if (controller) controller.abort();
    chat.length = 0;
    $("messages").replaceChildren();
    setBusy(false);
  });

  // -- dashboard ----------------------------------------------------------------------------
  const HISTORY = 120;
  const series = {
    running: [], waiting: [], used: [], cached: [], free: [], hit: [], hitAll: [],
    promptTps: [], genTps: [], ttft50: [], ttft90: [], ttft99: [], itl50: [], itl90: [], itl99: [],
  };
  let previous = null;

  function push(name, value) {
    const s = series[name];
    s.push(value === undefined ? null : value);
    if (s.length > HISTORY) s.shift();
  }

  const fmtS = (x) => (x === null || x === undefined ? "–" : x < 1 ? (x * 1000).toFixed(1) + " ms" : x.toFixed(2) + " s");
  const fmtN = (x) => (x === null || x === undefined ? "–" : Number.isInteger(x) ? String(x) : x.toFixed(1));
  const set = (id, text) => ($(id).textContent = text);

  async function pollStats() {
    let s;
    try {
      const r = await api("/v1/engine/stats" + (viewedModel() ? "?model=" + encodeURIComponent(viewedModel()) : ""));
      if (!r.ok) throw new Error(await errorMessage(r));
      s = await r.json();
    } catch (e) {
      $("engine-state").textContent = "unreachable";
      $("engine-state").className = "pill bad";
      return;
    }
    const e = s.engine;
    const f = s.frontend;
    $("model-name").textContent = s.model;
    $("engine-state").textContent = e.alive ? "engine running" : "engine down";
    $("engine-state").className = "pill " + (e.alive ? "ok" : "bad");
    if (e.running === undefined) return;
    let promptTps = null, genTps = null, hit = null;
    if (previous) {
      const dt = s.time - previous.time;
      if (dt > 0) {
        promptTps = (f.prompt_tokens - previous.frontend.prompt_tokens) / dt;
        genTps = (f.generation_tokens - previous.frontend.generation_tokens) / dt;
      }
      const dq = e.cache_queried_tokens - previous.engine.cache_queried_tokens;
      if (dq > 0) hit = (e.cache_hit_tokens - previous.engine.cache_hit_tokens) / dq;
    }
    previous = s;
    push("running", e.running);
    push("waiting", e.waiting);
    push("used", e.kv_pages_used);
    push("cached", e.kv_pages_evictable);
    push("free", e.kv_pages_free);
    push("hit", hit);
    push("hitAll", e.prefix_cache_hit_rate);
    push("promptTps", promptTps);
    push("genTps", genTps);
    push("ttft50", f.ttft_s.p50);
    push("ttft90", f.ttft_s.p90);
    push("ttft99", f.ttft_s.p99);
    push("itl50", f.itl_s.p50);
    push("itl90", f.itl_s.p90);
    push("itl99", f.itl_s.p99);
    set("stat-running", String(e.running));
    set("stat-waiting", String(e.waiting));
    set("stat-kv", `${e.kv_pages_used} / ${e.kv_pages_evictable} / ${e.kv_pages_free}`);
    set("stat-hit-rate", (100 * e.prefix_cache_hit_rate).toFixed(1) + " %");
    set("stat-prompt-tps", fmtN(promptTps));
    set("stat-gen-tps", fmtN(genTps));
    set("stat-finished", String(f.requests_finished));
    set("stat-gen-tokens", String(f.generation_tokens));
    set("stat-preemptions", String(e.preemptions));
    set("stat-ttft", [f.ttft_s.p50, f.ttft_s.p90, f.ttft_s.p99].map(fmtS).join(" / "));
    set("stat-itl", [f.itl_s.p50, f.itl_s.p90, f.itl_s.p99].map(fmtS).join(" / "));
    set("stat-radix-nodes", String(e.radix_nodes));
    set(
      "stat-spec",
      e.spec_proposed_tokens
        ? `${(100 * e.spec_acceptance_rate).toFixed(1)} % (${e.spec_mean_accepted_length.toFixed(2)} tokens)`
        : "off / none",
    );
    const rows = s.recent.map((q) => {
      const tr = document.createElement("tr");
      tr.dataset.id = q.id;
      const cells = [
        new Date(q.started * 1000).toLocaleTimeString(),
        q.id.slice(0, 12),
        q.prompt_tokens,
        q.cached_tokens,
        q.completion_tokens,
        fmtS(q.ttft_s),
        fmtS(q.e2e_s),
        fmtN(q.decode_tokens_per_s),
        q.finish_reason || "",
      ];
      for (const c of cells) {
        const td = document.createElement("td");
        td.textContent = String(c);
        tr.append(td);
      }
      return tr;
    });
    document.querySelector("#recent tbody").replaceChildren(...rows);
    if (!$("dashboard").hidden) drawCharts();
  }

  function drawChart(canvas, lines, opts = {}) {
    const dpr = window.devicePixelRatio || 1;
    const w = canvas.clientWidth || canvas.width;
    const h = canvas.clientHeight || canvas.height;
    canvas.width = w * dpr;
    canvas.height = h * dpr;
    const ctx = canvas.getContext("2d");
    ctx.scale(dpr, dpr);
    ctx.clearRect(0, 0, w, h);
    const style = getComputedStyle(document.documentElement);
    const colors = ["--c0", "--c1", "--c2"].map((v) => style.getPropertyValue(v).trim());
    let max = opts.max || 0;
    if (!opts.max) for (const l of lines) for (const v of l) if (v !== null && v > max) max = v;
    if (max <= 0) max = 1;
    const pad = 4, top = 14;
    ctx.strokeStyle = "#e2e2e6";
    ctx.fillStyle = "#6b6b74";
    ctx.font = "11px system-ui, sans-serif";
    for (const frac of [0, 0.5, 1]) {
      const y = top + (h - top - pad) * (1 - frac);
      ctx.beginPath();
      ctx.moveTo(0, y);
      ctx.lineTo(w, y);
      ctx.stroke();
    }
    ctx.fillText(opts.format ? opts.format(max) : fmtN(max), 2, 11);
    lines.forEach((l, i) => {
      ctx.strokeStyle = colors[i % colors.length];
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      let started = false;
      l.forEach((v, j) => {
        if (v === null) {
          started = false;
          return;
        }
        const x = (w * (j + HISTORY - l.length)) / (HISTORY - 1);
        const y = top + (h - top - pad) * (1 - v / max);
        if (started) ctx.lineTo(x, y);
        else ctx.moveTo(x, y);
        started = true;
      });
      ctx.stroke();
    });
  }

  function drawCharts() {
    drawChart($("chart-requests"), [series.running, series.waiting]);
    drawChart($("chart-kv"), [series.used, series.cached]);
    drawChart($("chart-hit"), [series.hit, series.hitAll], { max: 1, format: () => "100 %" });
    drawChart($("chart-tps"), [series.promptTps, series.genTps]);
    drawChart($("chart-ttft"), [series.ttft50, series.ttft90, series.ttft99], { format: fmtS });
    drawChart($("chart-itl"), [series.itl50, series.itl90, series.itl99], { format: fmtS });
  }

  // -- radix tree ---------------------------------------------------------------------------
  function visible(text) {
    return text.replace(/\n/g, "⏎").replace(/\t/g, "⇥");
  }

  async function refreshRadix() {
    radixLoaded = true;
    const info = $("radix-info");
    const q = new URLSearchParams({
      max_nodes: $("radix-max-nodes").value,
      max_depth: $("radix-max-depth").value,
    });
    if (viewedModel()) q.set("model", viewedModel());
    let s;
    try {
      const r = await api("/v1/engine/radix?" + q);
      if (!r.ok) throw new Error(await errorMessage(r));
      s = await r.json();
    } catch (e) {
      info.textContent = e.message;
      return;
    }
    info.textContent =
      `${s.total_nodes} nodes, ${s.total_tokens} tokens in ${s.namespaces} namespace(s); ` +
      `pages: ${s.evictable_pages} evictable, ${s.protected_pages} in use (page size ${s.page_size}); ` +
      `showing ${s.nodes.length}${s.truncated ? " (truncated)" : ""}; ` +
      `engine cost ${s.engine_cost_ms.toFixed(3)} ms`;
    const byId = new Map();
    const tree = $("radix-tree");
    tree.replaceChildren();
    const total = Math.max(1, s.total_tokens);
    for (const n of s.nodes) {
      const d = document.createElement("details");
      d.className = n.children ? "radix-node" : "radix-node leaf";
      d.open = n.depth < 4;
      d.dataset.id = String(n.id);
      d.dataset.tokens = String(n.tokens);
      d.dataset.subtreeTokens = String(n.subtree_tokens);
      d.dataset.children = String(n.children);
      d.dataset.locks = String(n.lock_count);
      const summary = document.createElement("summary");
      const bar = document.createElement("span");
      bar.className = "bar" + (n.lock_count > 0 ? " locked" : "");
      bar.style.width = Math.max(2, Math.round((160 * n.subtree_tokens) / total)) + "px";
      summary.append(bar);
      const label = document.createElement("span");
      label.className = "text";
      if (n.parent === -1) {
        label.textContent = "root";
      } else if (n.preview_text === null) {
        label.textContent = "(salted namespace: text hidden)";
      } else {
        label.textContent = visible(n.preview_text) + (n.tokens > n.preview_ids.length ? "…" : "");
      }
      summary.append(label);
      const meta = document.createElement("span");
      meta.className = "meta";
      const parts =
        n.parent === -1
          ? [`namespace ${n.namespace}`, `${n.subtree_tokens} tokens below`, `${n.children} children`]
          : [
              `${n.tokens} tok`,
              `${n.subtree_tokens} in subtree`,
              `${n.pages} pages`,
              n.tier === 1 ? "host tier" : "pool",
              `locks ${n.lock_count}`,
              `used ${n.age} cache ops ago`,
              `${n.children} children`,
            ];
      meta.textContent = parts.join(" · ");
      summary.append(meta);
      d.append(summary);
      byId.set(n.id, d);
      const parent = byId.get(n.parent);
      (parent || tree).append(d);
    }
  }
  $("radix-refresh").addEventListener("click", refreshRadix);

  // the conversation as sent to the model (for scripts and tests driving the page)
  window.radixserveConsole = {
    messages: () => chat.map((m) => ({ role: m.role, content: m.content })),
    renderMarkdown,
  };

  // the base model the dashboard and the radix view look at: the picked one's (an
  // adapter's parent), or none (the server's default model)
  function viewedModel() {
    const option = $("model-picker").selectedOptions[0];
    return option && option.dataset.base ? option.dataset.base : "";
  }

  // a server with several models (or LoRA adapters): the playground picks one, and the
  // dashboard shows its base model
  async function listModels() {
    let cards;
    try {
      const r = await api("/v1/models");
      if (!r.ok) return;
      cards = (await r.json()).data;
    } catch (e) {
      return;
    }
    if (cards.length < 2) return;
    const picker = $("model-picker");
    for (const card of cards) {
      const option = document.createElement("option");
      option.value = card.id;
      option.dataset.base = card.parent || card.id;
      const state = card.status && card.status !== "loaded" ? " (" + card.status + ")" : "";
      option.textContent = (card.parent ? card.parent + " / " : "") + card.id + state;
      picker.append(option);
    }
    $("model-picker-label").hidden = false;
    picker.addEventListener("change", () => (previous = null)); // rates are per model
  }

  // -- start ------------------------------------------------------------------------------
  listModels();
  showTab();
  setBusy(false);
  pollStats();
  setInterval(pollStats, 1000);
  window.addEventListener("resize", drawCharts);
})();
