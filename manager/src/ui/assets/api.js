// The REST API as the pages call it, and the live change feed (/ui/events, the store's watches as SSE). Every call
// presents the token the sign-in page kept in sessionStorage (this tab only; gone when it closes or on sign-out).

const TOKEN_KEY = 'corral-token';

/** The API token of this tab, or null. */
export function token() { return sessionStorage.getItem(TOKEN_KEY); }
export function setToken(t) { sessionStorage.setItem(TOKEN_KEY, t); }
export function signOut() { sessionStorage.removeItem(TOKEN_KEY); }

function authHeaders() {
  const t = token();
  return t ? { authorization: `Bearer ${t}` } : {};
}

const unauthorizedListeners = new Set();
/** Calls `f()` when the API answers 401 (no token, or one revoked meanwhile): the app shows the sign-in page. */
export function onUnauthorized(f) { unauthorizedListeners.add(f); }

/** An error answer of the API: `{code, message}` with its HTTP status. */
export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

async function answer(resp) {
  const text = await resp.text();
  let body = null;
  try { body = text ? JSON.parse(text) : null; } catch { body = null; }
  if (!resp.ok) {
    if (resp.status === 401) for (const f of unauthorizedListeners) f();
    throw new ApiError(resp.status, body?.code ?? 'error', body?.message ?? `${resp.status} ${resp.statusText}`);
  }
  return body;
}

/** `api('GET', '/v1/volumes')`; a body is sent as JSON. Throws ApiError for an error answer. */
export async function api(method, path, body) {
  const init = { method, headers: authHeaders() };
  if (body !== undefined) {
    init.headers['content-type'] = 'application/json';
    init.body = JSON.stringify(body);
  }
  let resp;
  try {
    resp = await fetch(path, init);
  } catch (e) {
    throw new ApiError(0, 'unreachable', `the manager did not answer: ${e.message}`);
  }
  return answer(resp);
}

/** Uploads `file` as the multipart form the upload route takes, reporting progress (0–100) as it is sent. */
export function upload(path, file, onProgress) {
  return new Promise((resolve, reject) => {
    const xhr = new XMLHttpRequest();
    xhr.open('POST', `${path}?size=${file.size}`);
    for (const [k, v] of Object.entries(authHeaders())) xhr.setRequestHeader(k, v);
    xhr.upload.onprogress = (e) => { if (e.lengthComputable) onProgress(Math.floor((100 * e.loaded) / e.total)); };
    xhr.onerror = () => reject(new ApiError(0, 'unreachable', 'the upload was cut off'));
    xhr.onload = () => {
      answer(new Response(xhr.responseText, { status: xhr.status, statusText: xhr.statusText }))
        .then(resolve, reject);
    };
    const form = new FormData();
    form.append('file', file, file.name);
    xhr.send(form);
  });
}

const listeners = new Set();

/** Calls `f(kind, name)` for every change the store reports. */
export function onChange(f) {
  listeners.add(f);
  return () => listeners.delete(f);
}

/** Opens the change feed; `status(text)` hears whether it is live. The feed is read with fetch (EventSource cannot
 * send the token) and reopened after a second when it ends. */
export function connectEvents(status) {
  let stopped = false;
  const dispatch = (data) => {
    let ev = { kind: '', name: '' };
    try { ev = JSON.parse(data); } catch { /* a malformed event refreshes everything */ }
    for (const f of listeners) f(ev.kind, ev.name);
  };
  const run = async () => {
    while (!stopped) {
      try {
        const resp = await fetch('/ui/events', { headers: { ...authHeaders(), accept: 'text/event-stream' } });
        if (resp.status === 401) { for (const f of unauthorizedListeners) f(); status('signed out'); return; }
        if (!resp.ok || !resp.body) throw new Error(String(resp.status));
        status('live');
        const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
        let buf = '';
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buf += value;
          let end;
          while ((end = buf.indexOf('\n\n')) >= 0) {
            const block = buf.slice(0, end);
            buf = buf.slice(end + 2);
            let event = 'message';
            const data = [];
            for (const line of block.split('\n')) {
              if (line.startsWith('event:')) event = line.slice(6).trim();
              else if (line.startsWith('data:')) data.push(line.slice(5).replace(/^ /, ''));
            }
            if (event === 'change') dispatch(data.join('\n'));
          }
        }
      } catch { /* reconnect below */ }
      if (stopped) return;
      status('reconnecting');
      await new Promise((r) => setTimeout(r, 1000));
    }
  };
  run();
  return { close: () => { stopped = true; } };
}
