// Volumes: the list (state, robustness, size, replicas, endpoint), create, and a volume's detail (replicas with
// their mode and rebuild progress, snapshots, attach/detach, expand, snapshot, backup, delete).

import { api } from '../api.js';
import { actionButton, badge, facts, fmtBytes, fmtTime, formDialog, h, heading, notice, parseSize, progress,
  table } from '../dom.js';

export const title = 'Volumes';
export const kinds = ['volume', 'replica', 'engine', 'snapshot', 'volume-clone', 'volume-restore', 'backup'];

const link = (name) => h('a', { href: `#/volumes/${encodeURIComponent(name)}`, key: `vol-${name}` }, name);

function replicasCell(v) {
  const running = v.replicas.filter((r) => r.mode === 'RW').length;
  return `${running} / ${v.numberOfReplicas}`;
}

function endpoint(v) {
  return v.endpoints.length ? h('code', { class: 'endpoint' }, v.endpoints[0]) : '';
}

function sizeOrThrow(text) {
  const size = parseSize(text);
  if (size === null) throw new Error(`size ${JSON.stringify(text)} is not a size: write bytes or a number with KiB, MiB, GiB or TiB`);
  return size;
}

/** The create form; `preset` fills fields (e.g. a restore from the backups page). */
export async function createVolume(preset = {}) {
  const images = await api('GET', '/v1/backingimages').catch(() => []);
  const nodes = await api('GET', '/v1/nodes').catch(() => []);
  return formDialog({
    title: preset.title ?? 'Create Volume',
    fields: [
      { name: 'name', label: 'Name', value: preset.name ?? '', matches: /volume name|volume ".*" already exists/ },
      { name: 'size', label: 'Size', value: preset.size ?? '1 GiB', inputmode: 'text',
        help: 'Bytes, or a number with KiB, MiB, GiB or TiB; a multiple of 4 KiB.',
        matches: /^size|volume size|not a size|smaller than|cannot be smaller/ },
      { name: 'numberOfReplicas', label: 'Number of replicas', type: 'number',
        value: String(preset.numberOfReplicas ?? Math.min(3, Math.max(1, nodes.length))),
        matches: /numberOfReplicas|replica|disk|node|room|schedul/i },
      { name: 'backingImage', label: 'Backing image', type: 'select', value: preset.backingImage ?? '',
        options: [['', 'None'], ...images.filter((b) => !b.deletionTimestamp).map((b) => [b.name, `${b.name} (${b.state})`])],
        matches: /backing image/i },
      { name: 'dataSource', label: 'Clone from (optional)', value: preset.dataSource ?? '',
        placeholder: 'vol://VOLUME or snap://VOLUME/SNAPSHOT', matches: /dataSource|source volume|clone|snapshot/ },
      { name: 'disableRevisionCounter', label: 'Revision counter', type: 'select', value: '',
        options: [['', 'Setting default'], ['false', 'Enabled'], ['true', 'Disabled']],
        help: 'Setting default: as disable-revision-counter says. Disabled: faster writes; after a crash the replica with the newest data is picked by file times.' },
      preset.fromBackup ? { name: 'fromBackup', label: 'Restore from backup', value: preset.fromBackup,
        matches: /backup/i } : null,
      preset.fromBackup ? { name: 'standby', label: 'Standby (DR) volume: keep restoring newer backups',
        type: 'checkbox', value: false, matches: /standby/ } : null,
    ].filter(Boolean),
    intro: preset.intro,
    submitLabel: preset.submitLabel ?? 'Create',
    submit: async (v) => {
      const body = { name: v.name, size: sizeOrThrow(v.size), numberOfReplicas: Number(v.numberOfReplicas) };
      if (v.backingImage) body.backingImage = v.backingImage;
      if (v.dataSource) body.dataSource = v.dataSource;
      if (v.disableRevisionCounter) body.disableRevisionCounter = v.disableRevisionCounter === 'true';
      if (v.fromBackup) body.fromBackup = v.fromBackup;
      if (v.standby) body.standby = true;
      await api('POST', '/v1/volumes', body);
      location.hash = `#/volumes/${encodeURIComponent(v.name)}`;
    },
  });
}

function attachButtons(v, area) {
  const name = encodeURIComponent(v.name);
  const attached = v.nodeId || v.state !== 'detached';
  return attached
    ? actionButton('Detach', area, () => api('POST', `/v1/volumes/${name}/detach`),
      { key: `detach-${v.name}`, confirm: `Detach volume ${v.name}? Its clients lose the device.` })
    : actionButton('Attach', area, () => api('POST', `/v1/volumes/${name}/attach`, {}), { key: `attach-${v.name}` });
}

function deleteButton(v, area, after) {
  return actionButton('Delete', area, async () => {
    await api('DELETE', `/v1/volumes/${encodeURIComponent(v.name)}`);
    after?.();
  }, { danger: true, key: `delete-${v.name}`, confirm: `Delete volume ${v.name} and all its replicas? Its data is gone.` });
}

export async function renderList() {
  const vols = await api('GET', '/v1/volumes');
  const area = notice();
  return h('section', {},
    heading('Volumes', h('button', { type: 'button', class: 'primary', key: 'create-volume', onclick: () => createVolume() },
      'Create Volume')),
    area,
    table({
      rows: vols,
      rowKey: (v) => v.name,
      empty: 'No volumes yet: create one.',
      columns: [
        { label: 'Name', cell: (v) => link(v.name) },
        { label: 'State', cell: (v) => badge(v.state) },
        { label: 'Robustness', cell: (v) => badge(v.robustness) },
        { label: 'Size', cell: (v) => fmtBytes(v.size) },
        { label: 'Replicas', cell: replicasCell },
        { label: 'Node', cell: (v) => v.currentNodeId ?? v.nodeId ?? '' },
        { label: 'Endpoint', cell: endpoint, class: 'wide' },
        { label: 'Operation', cell: (v) => h('div', { class: 'row-actions' }, attachButtons(v, area), deleteButton(v, area)) },
      ],
    }));
}

function snapshotRows(snaps) {
  // The chain as a tree: each snapshot indented under its parent (the volume head is the last child).
  const byParent = new Map();
  for (const s of snaps) {
    const p = s.parent ?? '';
    if (!byParent.has(p)) byParent.set(p, []);
    byParent.get(p).push(s);
  }
  const names = new Set(snaps.map((s) => s.name));
  const out = [];
  const walk = (parent, depth) => {
    for (const s of byParent.get(parent) ?? []) {
      out.push({ ...s, depth });
      walk(s.name, depth + 1);
    }
  };
  for (const root of snaps.filter((s) => !s.parent || !names.has(s.parent))) {
    out.push({ ...root, depth: 0 });
    walk(root.name, 1);
  }
  return out;
}

export async function renderDetail(name) {
  const q = encodeURIComponent(name);
  const v = await api('GET', `/v1/volumes/${q}`);
  const snaps = await api('GET', `/v1/volumes/${q}/snapshots`).catch(() => []);
  const area = notice();
  const attachedForIo = v.state === 'attached' && !v.frontendDisabled;
  return h('section', {},
    h('p', { class: 'crumbs' }, h('a', { href: '#/volumes' }, 'Volumes'), ' / ', name),
    heading(name,
      attachButtons(v, area),
      actionButton('Take Snapshot', area, () => api('POST', `/v1/volumes/${q}/snapshots`, {}),
        { key: 'take-snapshot', disabled: !attachedForIo, title: attachedForIo ? null : 'Attach the volume first' }),
      h('button', { type: 'button', disabled: v.state !== 'attached', onclick: () => formDialog({
        title: `Expand ${name}`, submitLabel: 'Expand',
        fields: [{ name: 'size', label: 'New size', value: fmtBytes(v.size), matches: /size|smaller/ }],
        submit: async (f) => { await api('POST', `/v1/volumes/${q}/expand`, { size: sizeOrThrow(f.size) }); },
      }) }, 'Expand'),
      h('button', { type: 'button', onclick: () => formDialog({
        title: `Back up ${name}`, submitLabel: 'Back up',
        fields: [{ name: 'snapshot', label: 'Snapshot (empty: take one now)', value: '', matches: /snapshot/ },
          { name: 'full', label: 'Full backup (read every block)', type: 'checkbox', value: false }],
        submit: async (f) => {
          await api('POST', '/v1/backups', { volume: name, snapshot: f.snapshot || null, full: f.full });
        },
      }) }, 'Back Up'),
      deleteButton(v, area, () => { location.hash = '#/volumes'; })),
    area,
    facts([
      ['State', badge(v.state)],
      ['Robustness', badge(v.robustness)],
      ['Size', fmtBytes(v.size)],
      ['Replicas wanted', String(v.numberOfReplicas)],
      ['Node', v.currentNodeId ?? v.nodeId ?? ''],
      ['Endpoints', v.endpoints.length ? h('ul', { class: 'plain' }, v.endpoints.map((e) => h('li', {}, h('code', {}, e)))) : ''],
      ['Backing image', v.backingImage ? h('a', { href: `#/backingimages/${encodeURIComponent(v.backingImage)}` }, v.backingImage) : ''],
      ['Revision counter', v.revisionCounterDisabled ? 'disabled' : 'enabled'],
      ['Frontend', v.frontendDisabled ? 'none (maintenance)' : v.frontend],
      ['Clone', v.cloneStatus ? h('span', {}, `${v.dataSource} `, badge(v.cloneStatus.state), ' ', progress(v.cloneStatus.progress, 'clone progress')) : ''],
      ['Message', v.message],
    ]),
    h('h2', {}, 'Replicas'),
    table({
      rows: v.replicas,
      rowKey: (r) => r.name,
      empty: 'No replicas yet: they are made at the first attach.',
      columns: [
        { label: 'Name', cell: (r) => r.name },
        { label: 'Node', cell: (r) => r.nodeId },
        { label: 'Disk', cell: (r) => r.disk },
        { label: 'State', cell: (r) => badge(r.failed ? 'failed' : r.state, r.message) },
        { label: 'Mode', cell: (r) => r.mode || '—' },
        { label: 'Rebuild', cell: (r) => (r.rebuildProgress !== null && r.rebuildProgress !== undefined
          ? progress(r.rebuildProgress, `rebuild of ${r.name}`) : '') },
      ],
    }),
    h('h2', {}, 'Snapshots'),
    table({
      rows: snapshotRows(snaps.filter((s) => !s.removed)),
      rowKey: (s) => s.name,
      empty: 'No snapshots.',
      columns: [
        { label: 'Name', cell: (s) => h('span', { class: 'tree', style: `--depth:${s.depth}` }, s.name) },
        { label: 'Created', cell: (s) => fmtTime(s.created) },
        { label: 'Size', cell: (s) => fmtBytes(s.size) },
        { label: 'Operation', cell: (s) => h('div', { class: 'row-actions' },
          actionButton('Revert', area, () => api('POST', `/v1/volumes/${q}/snapshots/${encodeURIComponent(s.name)}/revert`),
            { key: `revert-${s.name}`, confirm: `Revert ${name} to snapshot ${s.name}? Writes after it are lost.`, danger: true }),
          actionButton('Remove', area, () => api('DELETE', `/v1/volumes/${q}/snapshots/${encodeURIComponent(s.name)}`),
            { key: `rmsnap-${s.name}`, confirm: `Remove snapshot ${s.name}?`, danger: true })) },
      ],
    }));
}
