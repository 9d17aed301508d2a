// Talking to the server: the API key (asked for once, kept in this tab's sessionStorage, sent as
// "Authorization: Bearer"), and JSON GETs that ask for the key again when it is refused (401).

const KEY = "tripod.apiKey";
let pending = null; // the one login prompt open now, shared by every call waiting on it

export function apiKey() {
  return sessionStorage.getItem(KEY) || "";
}

export function authHeaders() {
  const k = apiKey();
  return k ? { Authorization: `Bearer ${k}` } : {};
}

export function askKey(message) {
  if (pending) return pending;
  const box = document.getElementById("login");
  const input = document.getElementById("login-key");
  document.getElementById("login-why").textContent = message || "This server needs its API key.";
  box.hidden = false;
  input.value = "";
  input.focus();
  pending = new Promise((resolve) => {
    const form = document.getElementById("login-form");
    form.onsubmit = (ev) => {
      ev.preventDefault();
      sessionStorage.setItem(KEY, input.value.trim());
      box.hidden = true;
      pending = null;
      resolve();
    };
  });
  return pending;
}

export class HttpError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function errorText(r) {
  try {
    const body = await r.json();
    return body?.error?.message || JSON.stringify(body);
  } catch {
    return r.statusText;
  }
}

export async function getJSON(path) {
  for (;;) {
    const r = await fetch(path, { headers: authHeaders(), cache: "no-store" });
    if (r.status === 401) {
      await askKey(await errorText(r));
      continue;
    }
    if (!r.ok) throw new HttpError(r.status, `${path}: ${r.status} ${await errorText(r)}`);
    return r.json();
  }
}

// A POST that streams Server-Sent Events: calls onEvent(parsed JSON) per "data:" line until
// [DONE]. Returns the Response's status; throws HttpError with the server's message on 4xx/5xx.
export async function postSSE(path, body, onEvent, signal) {
  for (;;) {
    const r = await fetch(path, {
      method: "POST", signal, body: JSON.stringify(body),
      headers: { "Content-Type": "application/json", ...authHeaders() },
    });
    if (r.status === 401) {
      await askKey(await errorText(r));
      continue;
    }
    if (!r.ok) throw new HttpError(r.status, `${r.status}: ${await errorText(r)}`);
    const reader = r.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") return r.status;
          onEvent(JSON.parse(data));
        }
      }
    }
    return r.status;
  }
}
