// Backing images as seed 000's UI items 1–8: create (name, sourceType, parameters, expectedChecksum; an upload
// sends the file once the image exists), batch deletion, columns Name / Size / Created From / Operation, a detail
// page with the parameters (or DOWNLOAD FROM URL), the checksums and a per-disk file table with progress and the
// message as a tooltip, Delete disabled while a volume uses the image, Clean Up with a disk table, and icons for
// deletion in progress and for an image whose every copy failed.

import { api, upload } from '../api.js';
import { actionButton, badge, confirmAction, facts, fmtBytes, fmtTime, formDialog, h, heading, notice, progress,
  showError, table } from '../dom.js';

export const title = 'Backing Images';
export const kinds = ['backingimage', 'volume'];

/** Names picked for batch deletion; kept across live re-renders. */
const selected = new Set();

function icons(b) {
  return [
    b.deletionTimestamp ? h('span', { class: 'icon deleting', title: 'Being deleted', role: 'img', 'aria-label': 'being deleted' }, '⌛') : null,
    unavailable(b) ? h('span', { class: 'icon unavailable', title: `Unavailable: every copy failed. ${failure(b)}`, role: 'img', 'aria-label': 'unavailable', key: `unavailable-${b.name}` }, '⚠') : null,
  ];
}

/** Seed 000 item 8: every disk record failed. */
const unavailable = (b) => b.state === 'failed' || (b.disks?.length > 0 && b.disks.every((d) => d.state === 'failed'));

/** Why: the image's message, else its disks' (each once). */
const failure = (b) => b.message || [...new Set((b.disks ?? []).map((d) => d.message).filter(Boolean))].join('; ');

const usersOf = (vols, name) => vols.filter((v) => v.backingImage === name).map((v) => v.name);

function deleteButton(b, users, area, after) {
  const inUse = users.length > 0;
  return actionButton('Delete', area, async () => {
    await api('DELETE', `/v1/backingimages/${encodeURIComponent(b.name)}`);
    selected.delete(b.name);
    after?.();
  }, {
    danger: true, key: `delete-${b.name}`, disabled: inUse || Boolean(b.deletionTimestamp),
    title: inUse ? `Used by volume(s) ${users.join(', ')}` : null,
    confirm: `Delete backing image ${b.name}? Its files on every disk go with it.`,
  });
}

function createDialog() {
  return formDialog({
    title: 'Create Backing Image',
    fields: [
      { name: 'name', label: 'Name', value: '', matches: /backing image name|backing image ".*" (already exists|is still)/ },
      { name: 'sourceType', label: 'Created from', type: 'select', value: 'download',
        options: [['download', 'Download from URL'], ['upload', 'Upload a file'], ['export-from-volume', 'Export from volume']],
        matches: /sourceType/ },
      { name: 'url', label: 'URL', value: '', placeholder: 'https://…/image.qcow2', matches: /url/i,
        showIf: (v) => v.sourceType === 'download' },
      { name: 'file', label: 'File', type: 'file', matches: /upload|file/i, showIf: (v) => v.sourceType === 'upload' },
      { name: 'volume', label: 'Volume', value: '', matches: /"volume"|volume/i, showIf: (v) => v.sourceType === 'export-from-volume' },
      { name: 'snapshot', label: 'Snapshot', value: '', matches: /snapshot/i, showIf: (v) => v.sourceType === 'export-from-volume' },
      { name: 'exportType', label: 'Export as', type: 'select', value: 'raw', options: [['raw', 'raw'], ['qcow2', 'qcow2']],
        matches: /exportType/, showIf: (v) => v.sourceType === 'export-from-volume' },
      { name: 'expectedChecksum', label: 'Expected SHA512 checksum (optional)', value: '', matches: /[Cc]hecksum/ },
      { name: 'minNumberOfCopies', label: 'Minimum number of copies (optional)', type: 'number', value: '',
        matches: /minNumberOfCopies/ },
    ],
    submit: async (v, form) => {
      const parameters = {};
      if (v.sourceType === 'download') parameters.url = v.url;
      if (v.sourceType === 'export-from-volume') Object.assign(parameters, { volume: v.volume, snapshot: v.snapshot, exportType: v.exportType });
      if (v.sourceType === 'upload' && !v.file) throw new Error('upload: choose the file to upload');
      const body = { name: v.name, sourceType: v.sourceType, parameters, expectedChecksum: v.expectedChecksum };
      if (v.minNumberOfCopies) body.minNumberOfCopies = Number(v.minNumberOfCopies);
      await api('POST', '/v1/backingimages', body);
      if (v.sourceType === 'upload') {
        // The manager waits (up to 30 s) for the image's data source to be ready for the data, then streams it on.
        form.status('Uploading…');
        try {
          await upload(`/v1/backingimages/${encodeURIComponent(v.name)}/upload`, v.file, (p) => form.status(`Uploading… ${p}%`));
        } catch (e) {
          e.message = `upload of the file failed: ${e.message} (the image ${v.name} exists; delete it to try again)`;
          throw e;
        }
      }
      location.hash = `#/backingimages/${encodeURIComponent(v.name)}`;
    },
  });
}

export async function renderList() {
  const [images, vols] = await Promise.all([api('GET', '/v1/backingimages'), api('GET', '/v1/volumes')]);
  for (const n of [...selected]) if (!images.some((b) => b.name === n && !b.deletionTimestamp)) selected.delete(n);
  const area = notice();
  const deletable = (b) => !b.deletionTimestamp && usersOf(vols, b.name).length === 0;
  const batch = h('button', { type: 'button', class: 'danger', key: 'batch-delete', disabled: selected.size === 0,
    onclick: async () => {
      const names = [...selected];
      if (!(await confirmAction(`Delete ${names.length} backing image(s): ${names.join(', ')}?`))) return;
      showError(area, null);
      const failed = [];
      for (const n of names) {
        try { await api('DELETE', `/v1/backingimages/${encodeURIComponent(n)}`); selected.delete(n); } catch (e) { failed.push(e.message); }
      }
      if (failed.length) showError(area, new Error(failed.join('; ')));
    } }, `Delete${selected.size ? ` (${selected.size})` : ''}`);
  const checkbox = (b) => h('input', {
    type: 'checkbox', key: `pick-${b.name}`, 'aria-label': `Select ${b.name}`, checked: selected.has(b.name),
    disabled: !deletable(b), title: deletable(b) ? null : 'In use or being deleted',
    onchange: (e) => {
      if (e.target.checked) selected.add(b.name); else selected.delete(b.name);
      batch.disabled = selected.size === 0;
      batch.textContent = `Delete${selected.size ? ` (${selected.size})` : ''}`;
    },
  });
  return h('section', {},
    heading('Backing Images', batch,
      h('button', { type: 'button', class: 'primary', key: 'create-bi', onclick: createDialog }, 'Create Backing Image')),
    area,
    table({
      rows: images,
      rowKey: (b) => b.name,
      empty: 'No backing images yet.',
      columns: [
        { label: 'Select', cell: checkbox, class: 'pick' },
        { label: 'Name', cell: (b) => h('span', {}, h('a', { href: `#/backingimages/${encodeURIComponent(b.name)}`, key: `bi-${b.name}` }, b.name), ' ', icons(b)) },
        { label: 'State', cell: (b) => h('span', {}, badge(b.state, b.message), b.state !== 'ready' && b.state !== 'failed' && b.progress ? progress(b.progress, `${b.name} progress`) : '') },
        { label: 'Size', cell: (b) => (b.size ? fmtBytes(b.size) : '') },
        { label: 'Created From', cell: (b) => b.sourceType },
        { label: 'Operation', cell: (b) => h('div', { class: 'row-actions' }, deleteButton(b, usersOf(vols, b.name), area)) },
      ],
    }));
}

export async function renderDetail(name) {
  const q = encodeURIComponent(name);
  const [b, vols] = await Promise.all([api('GET', `/v1/backingimages/${q}`), api('GET', '/v1/volumes')]);
  const users = usersOf(vols, name);
  const area = notice();
  const params = b.sourceType === 'download'
    ? [['DOWNLOAD FROM URL', h('a', { href: b.parameters.url, rel: 'noreferrer' }, b.parameters.url)]]
    : Object.entries(b.parameters).map(([k, val]) => [k, val]);
  const cleanup = () => {
    const copies = b.disks;
    return formDialog({
      title: `Clean up ${name}`, submitLabel: 'Clean Up',
      intro: 'Remove the copies on the disks picked (refused for a disk whose replicas use the image).',
      fields: copies.map((d) => ({ name: d.diskUUID, label: `${d.nodeId} · ${d.diskUUID} (${d.state})`, type: 'checkbox', value: false,
        matches: new RegExp(d.diskUUID) })),
      submit: async (v) => {
        const disks = Object.entries(v).filter(([, on]) => on).map(([k]) => k);
        await api('POST', `/v1/backingimages/${q}/cleanup`, { disks });
      },
    });
  };
  return h('section', {},
    h('p', { class: 'crumbs' }, h('a', { href: '#/backingimages' }, 'Backing Images'), ' / ', name),
    heading(h('span', {}, name, ' ', icons(b)),
      h('button', { type: 'button', onclick: cleanup, disabled: !b.disks.length }, 'Clean Up'),
      deleteButton(b, users, area, () => { location.hash = '#/backingimages'; })),
    area,
    facts([
      ['State', h('span', {}, badge(b.state, b.message))],
      ['UUID', b.uuid],
      ['Created From', b.sourceType],
      ...params,
      ['Size', b.size ? fmtBytes(b.size) : ''],
      ['Virtual size', b.virtualSize ? fmtBytes(b.virtualSize) : ''],
      ['Expected SHA512 Checksum', b.expectedChecksum ? h('code', { class: 'hash' }, b.expectedChecksum) : ''],
      ['Current SHA512 Checksum', b.currentChecksum ? h('code', { class: 'hash' }, b.currentChecksum) : ''],
      ['Minimum copies', String(b.minNumberOfCopies)],
      ['Used by', users.length ? users.map((u) => h('a', { href: `#/volumes/${encodeURIComponent(u)}` }, u, ' ')) : 'no volume'],
      ['Message', b.message],
    ]),
    h('h2', {}, 'Files on disks'),
    table({
      rows: b.disks,
      rowKey: (d) => d.diskUUID,
      empty: 'No copies yet.',
      columns: [
        { label: 'Disk', cell: (d) => h('code', {}, d.diskUUID) },
        { label: 'Node', cell: (d) => d.nodeId },
        { label: 'State', cell: (d) => badge(d.state, d.message || null) },
        { label: 'Progress', cell: (d) => (d.state === 'in-progress' ? progress(d.progress, `copy on ${d.diskUUID}`) : '') },
        { label: 'Unused since', cell: (d) => fmtTime(d.lastRefAt) },
        { label: 'Message', cell: (d) => (d.message ? h('span', { class: 'message', title: d.message }, 'ⓘ ', d.message) : '') },
      ],
    }));
}
