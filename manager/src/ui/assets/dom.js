// The UI kit the pages share: element building, sizes, tables that become cards on narrow screens, forms whose API
// errors land next to the field they concern, and confirmation before destructive actions.

import { ApiError } from './api.js';

/** `h('a', {href: '#/x', class: 'c', onclick: f}, 'text', child)`; null/false children are skipped. */
export function h(tag, props = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(props ?? {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith('on') && typeof v === 'function') el.addEventListener(k.slice(2), v);
    else if (k === 'class') el.className = v;
    else if (k === 'key') el.dataset.key = v;
    else if (k === 'value' && 'value' in el) el.value = v;
    else if (k === 'checked' || k === 'disabled' || k === 'selected') el[k] = Boolean(v);
    else el.setAttribute(k, v === true ? '' : String(v));
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const c of children) {
    if (c === null || c === undefined || c === false) continue;
    if (Array.isArray(c)) append(el, c);
    else el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
}

const UNITS = ['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'];

/** 1073741824 → "1 GiB". */
export function fmtBytes(n) {
  if (n === null || n === undefined) return '';
  let i = 0;
  let v = Number(n);
  while (v >= 1024 && i < UNITS.length - 1) { v /= 1024; i += 1; }
  return `${Number.isInteger(v) ? v : v.toFixed(1)} ${UNITS[i]}`;
}

/** "10 GiB", "512Mi", "4096" → bytes; null when it is not a size. Decimal units are read as binary ones. */
export function parseSize(text) {
  const m = /^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b?)\s*$/i.exec(text ?? '');
  if (!m) return null;
  const mult = { '': 1, k: 2 ** 10, m: 2 ** 20, g: 2 ** 30, t: 2 ** 40, p: 2 ** 50 }[m[2].toLowerCase()];
  if (m[2] === '' && m[3] !== '' && m[3].toLowerCase() !== 'b') return null;
  return Math.round(Number(m[1]) * mult);
}

/** Unix seconds or an RFC 3339 string → local date and time; empty stays empty. */
export function fmtTime(t) {
  if (!t) return '';
  const d = typeof t === 'number' ? new Date(t * 1000) : new Date(t);
  return Number.isNaN(d.getTime()) ? String(t) : d.toLocaleString();
}

const GOOD = new Set(['healthy', 'ready', 'running', 'attached', 'completed', 'true']);
const BAD = new Set(['faulted', 'failed', 'error', 'unavailable', 'false', 'stopped']);
const BUSY = new Set(['degraded', 'in-progress', 'starting', 'pending', 'attaching', 'detaching', 'deleting',
  'ready-for-transfer', 'copying', 'initiated', 'restoring', 'unknown']);

/** A state as a coloured word (the word itself carries the meaning; colour only helps). */
export function badge(state, title) {
  const s = String(state ?? '');
  const cls = GOOD.has(s) ? 'good' : BAD.has(s) ? 'bad' : BUSY.has(s) ? 'busy' : 'plain';
  return h('span', { class: `badge ${cls}`, title, 'data-state': s }, s || '—');
}

/** A progress bar with its number (for rebuilds, downloads, uploads, backups). */
export function progress(pct, label) {
  const p = Math.max(0, Math.min(100, Number(pct) || 0));
  return h('span', { class: 'progress' },
    h('progress', { max: 100, value: p, 'aria-label': label ?? 'progress' }), ` ${p}%`);
}

/**
 * A table: `columns` are `{label, cell: row => node|string, class}`. Below 640 px each row is a card whose cells
 * carry their column's label (CSS reads `data-label`).
 */
export function table({ columns, rows, empty = 'Nothing here yet.', caption, rowKey }) {
  if (!rows.length) return h('p', { class: 'empty' }, empty);
  return h('div', { class: 'table-wrap' },
    h('table', { class: 'grid' },
      caption ? h('caption', {}, caption) : null,
      h('thead', {}, h('tr', {}, columns.map((c) => h('th', { scope: 'col', class: c.class }, c.label)))),
      h('tbody', {}, rows.map((r) => h('tr', { 'data-row': rowKey ? rowKey(r) : null },
        columns.map((c) => h('td', { 'data-label': c.label, class: c.class }, c.cell(r))))))));
}

/** `<dl>` of [label, value] pairs; empty values are left out. */
export function facts(pairs) {
  return h('dl', { class: 'facts' }, pairs.filter(([, v]) => v !== '' && v !== null && v !== undefined)
    .map(([k, v]) => [h('dt', {}, k), h('dd', {}, v)]));
}

/** A page heading with its actions beside it. */
export function heading(title, ...actions) {
  return h('div', { class: 'heading' }, h('h1', {}, title), h('div', { class: 'actions' }, actions));
}

/** The page-level message area (for errors of row actions, which have no field). */
export function notice() {
  return h('div', { class: 'notice', role: 'alert', 'aria-live': 'assertive' });
}

/** Shows `e` in `area` (a notice), or clears it when `e` is null. */
export function showError(area, e) {
  area.replaceChildren(e ? h('p', {}, e.message) : '');
  area.classList.toggle('shown', Boolean(e));
}

const dialog = () => document.getElementById('dialog');

function open(content) {
  const d = dialog();
  d.replaceChildren(content);
  if (!d.open) d.showModal();
  return d;
}

/** Asks before a destructive action; resolves true only when the user confirms. */
export function confirmAction(question, action = 'Delete') {
  return new Promise((resolve) => {
    const done = (yes) => { dialog().close(); resolve(yes); };
    const no = h('button', { type: 'button', onclick: () => done(false) }, 'Cancel');
    const d = open(h('form', { method: 'dialog', class: 'confirm', onsubmit: (e) => { e.preventDefault(); done(true); } },
      h('h2', { id: 'dialog-title' }, 'Please confirm'),
      h('p', {}, question),
      h('div', { class: 'buttons' }, no, h('button', { type: 'submit', class: 'danger' }, action))));
    d.addEventListener('cancel', () => resolve(false), { once: true });
    no.focus();
  });
}

/**
 * A form in the dialog. `fields`: `{name, label, type, value, options, help, matches}` where `type` is text,
 * number, select, checkbox, file or textarea and `matches` is a RegExp of the API messages that concern the field.
 * `submit(values, form)` calls the API; an ApiError it throws is shown under the first field whose `matches` fits
 * the message (else above the buttons), and nothing is closed. Returns when the dialog is open.
 */
export function formDialog({ title, fields, submitLabel = 'Create', submit, intro }) {
  const inputs = {};
  const errors = {};
  const rowEls = {};
  const rows = fields.map((f) => {
    const id = `f-${f.name}`;
    const errId = `${id}-error`;
    const helpId = f.help ? `${id}-help` : null;
    let input;
    const common = { id, name: f.name, 'aria-describedby': [helpId, errId].filter(Boolean).join(' ') };
    if (f.type === 'select') {
      input = h('select', common, f.options.map(([v, label]) => h('option', { value: v, selected: v === f.value }, label)));
    } else if (f.type === 'checkbox') {
      input = h('input', { ...common, type: 'checkbox', checked: f.value });
    } else if (f.type === 'textarea') {
      input = h('textarea', { ...common, rows: 3 }, f.value ?? '');
    } else {
      input = h('input', { ...common, type: f.type ?? 'text', value: f.value ?? '', placeholder: f.placeholder,
        autocomplete: 'off', inputmode: f.inputmode, accept: f.accept });
    }
    inputs[f.name] = input;
    errors[f.name] = h('p', { id: errId, class: 'field-error', 'aria-live': 'polite' });
    const row = h('div', { class: `field ${f.type === 'checkbox' ? 'check' : ''}`, 'data-field': f.name },
      f.type === 'checkbox' ? [input, h('label', { for: id }, f.label)] : [h('label', { for: id }, f.label), input],
      f.help ? h('p', { id: helpId, class: 'help' }, f.help) : null,
      errors[f.name]);
    rowEls[f.name] = row;
    if (f.showIf) {
      const sync = () => { row.hidden = !f.showIf(values()); };
      queueMicrotask(() => {
        for (const other of Object.values(inputs)) other.addEventListener('change', sync);
        sync();
      });
    }
    return row;
  });
  const formError = h('p', { class: 'field-error form-error', role: 'alert' });
  const status = h('p', { class: 'form-status', 'aria-live': 'polite' });
  const values = () => Object.fromEntries(Object.entries(inputs).map(([k, el]) => [k,
    el.type === 'checkbox' ? el.checked : el.type === 'file' ? el.files[0] : el.value.trim()]));
  const ok = h('button', { type: 'submit', class: 'primary' }, submitLabel);
  const cancel = h('button', { type: 'button', onclick: () => dialog().close() }, 'Cancel');
  const clear = () => {
    for (const [k, el] of Object.entries(errors)) { el.textContent = ''; inputs[k].removeAttribute('aria-invalid'); }
    formError.textContent = '';
  };
  const form = h('form', {
    class: 'form', novalidate: true,
    onsubmit: async (e) => {
      e.preventDefault();
      clear();
      ok.disabled = true;
      try {
        await submit(values(), { status: (t) => { status.textContent = t; } });
        dialog().close();
      } catch (err) {
        const message = err instanceof ApiError || err instanceof Error ? err.message : String(err);
        const f = fields.find((x) => x.matches && x.matches.test(message) && !rowEls[x.name].hidden);
        if (f) {
          errors[f.name].textContent = message;
          inputs[f.name].setAttribute('aria-invalid', 'true');
          inputs[f.name].focus();
        } else {
          formError.textContent = message;
        }
        status.textContent = '';
      } finally {
        ok.disabled = false;
      }
    },
  },
  h('h2', { id: 'dialog-title' }, title),
  intro ? h('p', { class: 'help' }, intro) : null,
  rows, formError, status,
  h('div', { class: 'buttons' }, cancel, ok));
  open(form);
  const first = fields.find((f) => f.type !== 'hidden');
  if (first) inputs[first.name].focus();
  return form;
}

/** A button that runs an API action, shows its error in `area`, and asks first when `confirm` is set. */
export function actionButton(label, area, run, { confirm, danger, disabled, title, key } = {}) {
  return h('button', {
    type: 'button', class: danger ? 'danger' : null, disabled, title, key,
    onclick: async (e) => {
      const btn = e.currentTarget;
      if (confirm && !(await confirmAction(confirm, label))) return;
      showError(area, null);
      btn.disabled = true;
      try { await run(); } catch (err) { showError(area, err); } finally { btn.disabled = false; }
    },
  }, label);
}
