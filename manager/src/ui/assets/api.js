// The REST API as the pages call it, and the live change feed (/ui/events, the store's watches as SSE).

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
    throw new ApiError(resp.status, body?.code ?? 'error', body?.message ?? `${resp.status} ${resp.statusText}`);
  }
  return body;
}

/** `api('GET', '/v1/volumes')`; a body is sent as JSON. Throws ApiError for an error answer. */
export async function api(method, path, body) {
  const init = { method, headers: {} };
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

/** Opens the change feed; `status(text)` hears whether it is live. EventSource reconnects by itself. */
export function connectEvents(status) {
  const es = new EventSource('/ui/events');
  es.onopen = () => status('live');
  es.onerror = () => status('reconnecting');
  es.addEventListener('change', (e) => {
    let ev = { kind: '', name: '' };
    try { ev = JSON.parse(e.data); } catch { /* a malformed event refreshes everything */ }
    for (const f of listeners) f(ev.kind, ev.name);
  });
  return es;
}
