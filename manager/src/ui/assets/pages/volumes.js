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

/** Where a new volume's data comes from: [value, label]. */
const SOURCES = [['', 'Nothing (empty volume)'], ['volume', 'Another volume (clone)'],
  ['snapshot', 'A snapshot (clone)'], ['backup', 'A backup (restore)']];

/**
 * The create form; `preset` fills fields: `source` ('volume' | 'snapshot' | 'backup') with `sourceVolume`,
 * `snapshot` or `fromBackup` (the clone button of a volume or snapshot, a restore from the backups page).
 */
export async function createVolume(preset = {}) {
  const [images, nodes, vols, backups] = await Promise.all([
    api('GET', '/v1/backingimages').catch(() => []), api('GET', '/v1/nodes').catch(() => []),
    api('GET', '/v1/volumes').catch(() => []), api('GET', '/v1/backups').catch(() => [])]);
  const completed = backups.filter((b) => b.state === 'completed');
  const isClone = (v) => v.source === 'volume' || v.source === 'snapshot';
  return formDialog({
    title: preset.title ?? 'Create Volume',
    fields: [
      { name: 'name', label: 'Name', value: preset.name ?? '', matches: /volume name|volume ".*" already exists/ },
      { name: 'size', label: 'Size', value: preset.size ?? '1 GiB', inputmode: 'text',
        help: 'Bytes, or a number with KiB, MiB, GiB or TiB; a multiple of 4 KiB.',
        matches: /^size|volume size|not a size|smaller than|cannot be smaller/ },
      { name: 'numberOfReplicas', label: 'Number of replicas', type: 'number',
        value: String(preset.numberOfReplicas ?? Math.min(3, Math.max(1, nodes.length))),
        // A v2 placement refusal ("no schedulable v2 disk") belongs to the data engine below.
        matches: /^(?!.*\bv2\b).*(numberOfReplicas|replica|disk|node|room|schedul)/i },
      { name: 'dataEngine', label: 'Data engine', type: 'select', value: preset.dataEngine ?? '',
        options: [['', 'Setting default'], ['v1', 'v1 (snapshot files)'], ['v2', 'v2 (logical-volume store)']],
        help: 'v2 places replicas only on disks added with the v2 engine.',
        matches: /data ?engine|v2 disk|v2 data engine/i },
      { name: 'source', label: 'Create from', type: 'select', value: preset.source ?? '', options: SOURCES },
      { name: 'sourceVolume', label: 'Source volume', type: 'select', value: preset.sourceVolume ?? '',
        options: [['', 'Choose a volume'], ...vols.map((v) => [v.name, v.name])],
        matches: /source volume|dataSource|itself a clone/, showIf: isClone },
      { name: 'snapshot', label: 'Source snapshot', value: preset.snapshot ?? '', matches: /snapshot/,
        help: 'A snapshot of the source volume (its page lists them).', showIf: (v) => v.source === 'snapshot' },
      { name: 'fromBackup', label: 'Backup', type: 'select', value: preset.fromBackup ?? '',
        options: [['', 'Choose a backup'], ...completed.map((b) => [b.id, `${b.id} (${b.volume}, ${fmtBytes(b.size)})`])],
        matches: /backup "|backup .* (not|is)|fromBackup|restore/, showIf: (v) => v.source === 'backup' },
      { name: 'standby', label: 'Standby (DR) volume: keep restoring newer backups until activated',
        type: 'checkbox', value: preset.standby ?? false, matches: /standby/, showIf: (v) => v.source === 'backup' },
      { name: 'backingImage', label: 'Backing image', type: 'select', value: preset.backingImage ?? '',
        options: [['', 'None'], ...images.filter((b) => !b.deletionTimestamp).map((b) => [b.name, `${b.name} (${b.state})`])],
        help: 'A clone takes its source\'s, a restore the backup\'s unless another is chosen.',
        matches: /backing image/i, showIf: (v) => !isClone(v) },
      { name: 'disableRevisionCounter', label: 'Revision counter', type: 'select', value: preset.disableRevisionCounter ?? '',
        options: [['', 'Setting default'], ['false', 'Enabled'], ['true', 'Disabled']],
        help: 'Setting default: as disable-revision-counter says. Disabled: faster writes; after a crash the replica with the newest data is picked by file times.' },
    ],
    intro: preset.intro,
    submitLabel: preset.submitLabel ?? 'Create',
    submit: async (v) => {
      const body = { name: v.name, size: sizeOrThrow(v.size), numberOfReplicas: Number(v.numberOfReplicas) };
      if (v.backingImage && !isClone(v)) body.backingImage = v.backingImage;
      if (isClone(v)) {
        if (!v.sourceVolume) throw new Error('source volume: choose the volume to clone');
        if (v.source === 'snapshot' && !v.snapshot) throw new Error('snapshot: name the snapshot to clone');
        body.dataSource = v.source === 'volume' ? `vol://${v.sourceVolume}` : `snap://${v.sourceVolume}/${v.snapshot}`;
      }
      if (v.source === 'backup') {
        if (!v.fromBackup) throw new Error('fromBackup: choose the backup to restore');
        body.fromBackup = v.fromBackup;
        if (v.standby) body.standby = true;
      }
      if (v.dataEngine) body.dataEngine = v.dataEngine;
      if (v.disableRevisionCounter) body.disableRevisionCounter = v.disableRevisionCounter === 'true';
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

/** A DR volume's standing: following its backup volume, activating, or activated (a normal volume since). */
function standbyFact(restore, restoring) {
  if (!restore || !(restore.standby || restore.activate)) return '';
  if (restoring) return restore.activate ? 'activating' : `yes: follows backup volume ${restore.backupVolume}`;
  return restore.state === 'completed' ? `activated (followed ${restore.backupVolume})` : '';
}

export async function renderDetail(name) {
  const q = encodeURIComponent(name);
  const v = await api('GET', `/v1/volumes/${q}`);
  const [snaps, restore] = await Promise.all([
    api('GET', `/v1/volumes/${q}/snapshots`).catch(() => []),
    // 404 for a volume never restored from a backup.
    api('GET', `/v1/volumes/${q}/restore`).catch(() => null)]);
  const area = notice();
  const restoring = restore && ['initiated', 'restoring'].includes(restore.state);
  const clone = (extra) => createVolume({ title: `Clone ${name}`, name: `${name}-clone`, size: String(v.size),
    numberOfReplicas: v.numberOfReplicas, sourceVolume: name, source: 'volume', ...extra });
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
      h('button', { type: 'button', key: 'clone-volume', onclick: () => clone({}) }, 'Clone'),
      restore?.standby && restoring ? actionButton('Activate', area,
        () => api('POST', `/v1/volumes/${q}/activate`), { key: 'activate',
          disabled: restore.activate, title: restore.activate ? 'Activation asked: the last restore runs' : null,
          confirm: `Activate standby volume ${name}? It restores the newest backup once more, then becomes a normal volume that no longer follows ${restore.backupVolume}.` }) : null,
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
      ['Restore', restore ? h('span', { class: 'restore' }, `${restore.target}:${restore.backup} `, badge(restore.state, restore.message || null),
        restoring ? progress(restore.progress, 'restore progress') : '') : ''],
      ['Standby (DR)', standbyFact(restore, restoring)],
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
          h('button', { type: 'button', key: `clone-${s.name}`, onclick: () => clone({ source: 'snapshot', snapshot: s.name,
            title: `Clone snapshot ${s.name}` }) }, 'Clone'),
          actionButton('Revert', area, () => api('POST', `/v1/volumes/${q}/snapshots/${encodeURIComponent(s.name)}/revert`),
            { key: `revert-${s.name}`, confirm: `Revert ${name} to snapshot ${s.name}? Writes after it are lost.`, danger: true }),
          actionButton('Remove', area, () => api('DELETE', `/v1/volumes/${q}/snapshots/${encodeURIComponent(s.name)}`),
            { key: `rmsnap-${s.name}`, confirm: `Remove snapshot ${s.name}?`, danger: true })) },
      ],
    }));
}
