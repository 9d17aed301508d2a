// The playground: a streamed chat against this server's (or fleet's) /v1/chat/completions, with
// sampling controls, an optional JSON schema, and the request shown as curl and as Python.

import { apiKey, getJSON, postSSE } from "./api.js";

const $ = (id) => document.getElementById(id);

export class Playground {
  constructor() {
    this.history = [];
    this.controller = null;
    for (const id of ["pg-model", "pg-system", "pg-temperature", "pg-top_p", "pg-max_tokens", "pg-seed", "pg-schema", "pg-input"]) {
      $(id).addEventListener("input", () => this.showRequest());
    }
    $("pg-send").onclick = () => this.send();
    $("pg-stop").onclick = () => this.controller?.abort();
    $("pg-clear").onclick = () => { this.history = []; $("pg-transcript").innerHTML = ""; this.showRequest(); };
    $("pg-input").addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); this.send(); }
    });
  }

  async load() {
    if (this.loaded) return;
    const models = await getJSON("/v1/models");
    $("pg-model").innerHTML = models.data.map((m) => `<option>${m.id}</option>`).join("");
    this.loaded = true;
    this.showRequest();
  }

  // The request body for the conversation so far plus `text`; throws on a schema that is not JSON.
  body(text) {
    const num = (id) => ($(id).value === "" ? null : Number($(id).value));
    const messages = [];
    if ($("pg-system").value.trim()) messages.push({ role: "system", content: $("pg-system").value });
    messages.push(...this.history, { role: "user", content: text });
    const body = { model: $("pg-model").value, messages, stream: true, stream_options: { include_usage: true } };
    for (const k of ["temperature", "top_p", "max_tokens", "seed"]) {
      const v = num(`pg-${k}`);
      if (v !== null && !Number.isNaN(v)) body[k] = v;
    }
    const schemaText = $("pg-schema").value.trim();
    if (schemaText) {
      let schema;
      try {
        schema = JSON.parse(schemaText);
      } catch (e) {
        throw new Error(`the JSON schema is not valid JSON: ${e.message}`);
      }
      body.response_format = { type: "json_schema", json_schema: { name: "answer", schema, strict: true } };
    }
    return body;
  }

  showRequest() {
    let body;
    try {
      body = this.body($("pg-input").value || "Hello!");
      $("pg-schema-error").textContent = "";
    } catch (e) {
      $("pg-schema-error").textContent = e.message;
      return;
    }
    const base = `${location.origin}`;
    const json = JSON.stringify(body, null, 2);
    const auth = apiKey() ? ` \\\n  -H "Authorization: Bearer $TRIPOD_API_KEY"` : "";
    $("pg-curl").textContent = `curl -N ${base}/v1/chat/completions \\\n  -H "Content-Type: application/json"${auth} \\\n` +
      `  -d '${json.replace(/'/g, "'\\''")}'`;
    const { model, messages, stream, stream_options, ...rest } = body;
    const kw = Object.entries(rest).map(([k, v]) => `    ${k}=${py(v, 4)},`).join("\n");
    $("pg-python").textContent = `import os\nfrom openai import OpenAI\n\n` +
      `client = OpenAI(base_url="${base}/v1", api_key=os.environ.get("TRIPOD_API_KEY", "unused"))\n` +
      `stream = client.chat.completions.create(\n    model=${py(model, 4)},\n    messages=${py(messages, 4)},\n` +
      `    stream=True,\n    stream_options=${py(stream_options, 4)},\n${kw}\n)\n` +
      `for chunk in stream:\n    if chunk.choices and chunk.choices[0].delta.content:\n` +
      `        print(chunk.choices[0].delta.content, end="", flush=True)\n`;
  }

  bubble(role, text) {
    const div = document.createElement("div");
    div.className = `msg ${role}`;
    div.innerHTML = `<div class="role">${role}</div><div class="text"></div><div class="check"></div>`;
    div.querySelector(".text").textContent = text;
    $("pg-transcript").appendChild(div);
    $("pg-transcript").scrollTop = 1e9;
    return div;
  }

  async send() {
    const text = $("pg-input").value.trim();
    if (!text || this.controller) return;
    $("pg-error").textContent = "";
    let body;
    try {
      body = this.body(text);
    } catch (e) {
      $("pg-error").textContent = e.message;
      return;
    }
    this.showRequest();
    $("pg-input").value = "";
    this.bubble("user", text);
    const out = this.bubble("assistant", "");
    const answer = out.querySelector(".text");
    out.dataset.done = "0";
    out.dataset.chunks = "0";
    this.controller = new AbortController();
    $("pg-send").disabled = true;
    $("pg-stop").disabled = false;
    const t0 = performance.now();
    let first = null, usage = null, finish = null, chunks = 0;
    try {
      await postSSE("/v1/chat/completions", body, (ev) => {
        if (ev.error) throw new Error(ev.error.message || JSON.stringify(ev.error));
        if (ev.usage) usage = ev.usage;
        for (const ch of ev.choices || []) {
          const piece = ch.delta?.content;
          if (piece) {
            first ??= performance.now();
            answer.textContent += piece;
            out.dataset.chunks = String(++chunks);
            $("pg-transcript").scrollTop = 1e9;
          }
          if (ch.finish_reason) finish = ch.finish_reason;
        }
      }, this.controller.signal);
      this.history.push({ role: "user", content: text }, { role: "assistant", content: answer.textContent });
    } catch (e) {
      $("pg-error").textContent = e.name === "AbortError" ? "stopped" : e.message;
    } finally {
      const t1 = performance.now();
      const n = usage?.completion_tokens ?? chunks;
      const rate = first !== null && n > 1 && t1 > first ? ((n - 1) * 1000) / (t1 - first) : null;
      $("pg-stats").textContent = first === null ? "" : `TTFT ${(first - t0).toFixed(0)} ms · ${n} tokens` +
        (rate ? ` · ${rate.toFixed(1)} tok/s` : "") + (finish ? ` · finish: ${finish}` : "") +
        (usage?.prompt_tokens_details?.cached_tokens ? ` · ${usage.prompt_tokens_details.cached_tokens} prompt tokens cached` : "");
      if (body.response_format) {
        const check = out.querySelector(".check");
        try {
          JSON.parse(answer.textContent);
          check.textContent = "✓ valid JSON (constrained by the schema)";
          check.className = "check ok";
        } catch {
          check.textContent = finish === "length" ? "✗ cut by max_tokens before the JSON closed" : "✗ not JSON";
          check.className = "check bad";
        }
      }
      out.dataset.finish = finish ?? "";
      out.dataset.done = "1";
      this.controller = null;
      $("pg-send").disabled = false;
      $("pg-stop").disabled = true;
    }
  }
}

// A JSON value as a Python literal (True/False/None; JSON strings are valid Python strings),
// indented as the code around it (`indent` spaces).
function py(v, indent) {
  const pad = " ".repeat(indent);
  if (v === null || v === undefined) return "None";
  if (v === true || v === false) return v ? "True" : "False";
  if (typeof v !== "object") return JSON.stringify(v);
  const items = Array.isArray(v) ? v.map((x) => py(x, indent + 4))
    : Object.entries(v).map(([k, x]) => `${JSON.stringify(k)}: ${py(x, indent + 4)}`);
  const [open, close] = Array.isArray(v) ? ["[", "]"] : ["{", "}"];
  if (!items.length) return open + close;
  return `${open}\n${items.map((s) => `${pad}    ${s},`).join("\n")}\n${pad}${close}`;
}
