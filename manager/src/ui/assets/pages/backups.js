// Backups: targets, backup volumes and their backups (progress while they run); restore into a new volume or a
// standby (DR) volume with "Use previous backing image" checked by default, as seed 000's "Modify Backup page".

import { api } from '../api.js';
import { actionButton, badge, fmtBytes, fmtTime, formDialog, h, heading, notice, progress, table } from '../dom.js';

export const title = 'Backups';
export const kinds = ['backup-target', 'backup-volume', 'backup', 'volume-restore'];

function setTarget(t) {
  return formDialog({
    title: t ? `Backup target ${t.name}` : 'Set Backup Target', submitLabel: 'Save',
    fields: [
      { name: 'name', label: 'Name', value: t?.name ?? 'default', matches: /backup target "/ },
      { name: 'url', label: 'URL', value: t?.url ?? '', placeholder: 's3://bucket/prefix or file:///path', matches: /url|list|scheme/i },
      { name: 'endpoint', label: 'S3 endpoint (optional)', value: t?.endpoint ?? '', matches: /endpoint/ },
      { name: 'region', label: 'Region (optional)', value: t?.region ?? '', matches: /region/ },
    ],
    submit: (v) => api('PUT', `/v1/backuptargets/${encodeURIComponent(v.name)}`, { url: v.url, endpoint: v.endpoint, region: v.region }),
  });
}

function imageInfo(bv) {
  return formDialog({
    title: `Backing image of ${bv.name}`, submitLabel: 'Close', fields: [],
    intro: `${bv.backingImageName} · SHA-512 ${bv.backingImageChecksum || 'not recorded'}`,
    submit: async () => {},
  });
}

async function restore(b, bv, { standby = false } = {}) {
  const images = await api('GET', '/v1/backingimages').catch(() => []);
  const previous = bv?.backingImageName || b.backingImageName;
  return formDialog({
    title: standby ? `DR volume from ${b.volume}` : `Restore ${b.name}`, submitLabel: standby ? 'Create DR Volume' : 'Restore',
    intro: `Backup of volume ${b.volume}, ${fmtBytes(b.size)}, made ${fmtTime(b.completed)}.`,
    fields: [
      { name: 'name', label: 'New volume name', value: `${b.volume}-${standby ? 'dr' : 'restore'}`, matches: /volume name|volume ".*" already exists/ },
      { name: 'size', label: 'Size in bytes', type: 'number', value: String(b.size), matches: /size|smaller/ },
      { name: 'numberOfReplicas', label: 'Number of replicas', type: 'number', value: '3', matches: /numberOfReplicas|replica|room|disk|node/i },
      previous ? { name: 'usePrevious', label: `Use previous backing image (${previous})`, type: 'checkbox', value: true } : null,
      { name: 'backingImage', label: 'Backing image', type: 'select', value: '',
        options: [['', 'None'], ...images.map((i) => [i.name, `${i.name} (${i.state})`])],
        matches: /backing image/i, showIf: (v) => !previous || !v.usePrevious },
      { name: 'standby', label: 'Standby (DR) volume: keep restoring newer backups until activated', type: 'checkbox', value: standby, matches: /standby/ },
    ].filter(Boolean),
    submit: async (v) => {
      const body = { name: v.name, size: Number(v.size), numberOfReplicas: Number(v.numberOfReplicas), fromBackup: b.id, standby: v.standby };
      if (!(previous && v.usePrevious) && v.backingImage) body.backingImage = v.backingImage;
      await api('POST', '/v1/volumes', body);
      location.hash = `#/volumes/${encodeURIComponent(v.name)}`;
    },
  });
}

/** Create DR Volume: a standby volume restored from the backup volume's newest backup, following the next ones. */
function drButton(bv, backups) {
  const last = backups.find((b) => b.target === bv.target && b.volume === bv.name && b.name === bv.lastBackupName
    && b.state === 'completed');
  return h('button', { type: 'button', key: `dr-${bv.id}`, disabled: !last,
    title: last ? null : 'No completed backup yet', onclick: () => restore(last, bv, { standby: true }) }, 'Create DR Volume');
}

export async function render() {
  const [targets, bvs, backups] = await Promise.all([
    api('GET', '/v1/backuptargets'), api('GET', '/v1/backupvolumes'), api('GET', '/v1/backups')]);
  const area = notice();
  return h('section', {},
    heading('Backups', h('button', { type: 'button', key: 'set-target', onclick: () => setTarget(null) }, 'Set Backup Target')),
    area,
    h('h2', {}, 'Targets'),
    table({
      rows: targets, rowKey: (t) => t.name, empty: 'No backup target: set one to back volumes up.',
      columns: [
        { label: 'Name', cell: (t) => t.name },
        { label: 'URL', cell: (t) => h('code', {}, t.url), class: 'wide' },
        { label: 'Available', cell: (t) => badge(t.available ? 'ready' : 'unavailable', t.message || null) },
        { label: 'Operation', cell: (t) => h('div', { class: 'row-actions' },
          h('button', { type: 'button', onclick: () => setTarget(t) }, 'Edit'),
          actionButton('Forget', area, () => api('DELETE', `/v1/backuptargets/${encodeURIComponent(t.name)}`),
            { danger: true, confirm: `Forget backup target ${t.name}? Its data stays where it is.` })) },
      ],
    }),
    h('h2', {}, 'Backup volumes'),
    table({
      rows: bvs, rowKey: (v) => v.id, empty: 'No backup volumes.',
      columns: [
        { label: 'Name', cell: (v) => v.id },
        { label: 'Size', cell: (v) => fmtBytes(v.size) },
        { label: 'Backups', cell: (v) => String(v.backupCount ?? '') },
        { label: 'Last backup', cell: (v) => `${v.lastBackupName} ${fmtTime(v.lastBackupAt)}` },
        { label: 'Operation', cell: (v) => h('div', { class: 'row-actions' },
          h('button', { type: 'button', disabled: !v.backingImageName, title: v.backingImageName ? null : 'No backing image',
            key: `bi-info-${v.id}`, onclick: () => imageInfo(v) }, 'Backing Image Info'),
          drButton(v, backups),
          actionButton('Delete', area, () => api('DELETE', `/v1/backupvolumes/${encodeURIComponent(v.id)}`),
            { danger: true, confirm: `Delete backup volume ${v.id} with every backup in it?` })) },
      ],
    }),
    h('h2', {}, 'Backups'),
    table({
      rows: backups, rowKey: (b) => b.id, empty: 'No backups.',
      columns: [
        { label: 'Backup', cell: (b) => b.id },
        { label: 'Volume', cell: (b) => b.volume },
        { label: 'State', cell: (b) => h('span', {}, badge(b.state, b.error || null), b.state === 'in-progress' ? progress(b.progress, `backup ${b.name}`) : '') },
        { label: 'Size', cell: (b) => fmtBytes(b.size) },
        { label: 'Snapshot', cell: (b) => b.snapshot },
        { label: 'Completed', cell: (b) => fmtTime(b.completed) },
        { label: 'Operation', cell: (b) => h('div', { class: 'row-actions' },
          h('button', { type: 'button', key: `restore-${b.id}`, disabled: b.state !== 'completed',
            onclick: () => restore(b, bvs.find((v) => v.name === b.volume && v.target === b.target)) }, 'Restore'),
          actionButton('Delete', area, () => api('DELETE', `/v1/backups/${encodeURIComponent(b.id)}`),
            { danger: true, confirm: `Delete backup ${b.id}? Blocks no other backup uses are collected.` })) },
      ],
    }));
}
