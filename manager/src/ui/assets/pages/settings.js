// Settings: every setting with its value, default and meaning; each saved on its own with the API's answer beside it.

import { api } from '../api.js';
import { h, heading } from '../dom.js';

export const title = 'Settings';
export const kinds = ['setting'];

function row(s) {
  const id = `setting-${s.name}`;
  const err = h('p', { id: `${id}-error`, class: 'field-error', 'aria-live': 'polite' });
  const boolean = s.default === 'true' || s.default === 'false';
  const input = boolean
    ? h('select', { id, name: s.name, 'aria-describedby': `${id}-help ${id}-error` },
      ['true', 'false'].map((v) => h('option', { value: v, selected: v === s.value }, v)))
    : h('input', { id, name: s.name, value: s.value, inputmode: 'numeric', 'aria-describedby': `${id}-help ${id}-error` });
  const save = h('button', { type: 'submit' }, 'Save');
  return h('form', {
    class: 'setting', novalidate: true, 'data-setting': s.name,
    onsubmit: async (e) => {
      e.preventDefault();
      err.textContent = '';
      input.removeAttribute('aria-invalid');
      save.disabled = true;
      try {
        await api('PUT', `/v1/settings/${encodeURIComponent(s.name)}`, { value: input.value.trim() });
        err.textContent = 'Saved.';
      } catch (x) {
        err.textContent = x.message;
        input.setAttribute('aria-invalid', 'true');
      } finally {
        save.disabled = false;
      }
    },
  },
  h('label', { for: id }, s.name),
  h('p', { id: `${id}-help`, class: 'help' }, `${s.description} Default: ${s.default}.`),
  h('div', { class: 'inline' }, input, save),
  err);
}

export async function render() {
  const settings = await api('GET', '/v1/settings');
  return h('section', {}, heading('Settings'), h('div', { class: 'settings' }, settings.map(row)));
}
