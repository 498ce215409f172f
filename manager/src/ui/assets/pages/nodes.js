// Nodes and their disks: readiness, scheduling, capacity; add and remove a disk.

import { api } from '../api.js';
import { actionButton, badge, fmtBytes, fmtTime, formDialog, h, heading, notice, table } from '../dom.js';

export const title = 'Nodes';
export const kinds = ['node', 'replica'];

function addDisk(node) {
  return formDialog({
    title: `Add a disk to ${node}`, submitLabel: 'Add Disk',
    fields: [
      { name: 'name', label: 'Disk name', value: '', matches: /disk name|already has a disk/ },
      { name: 'path', label: 'Path', value: '', placeholder: '/var/lib/corral/disk2', matches: /path|already uses/ },
      { name: 'allowScheduling', label: 'Allow scheduling', type: 'checkbox', value: true },
      { name: 'storageReserved', label: 'Reserved bytes', type: 'number', value: '0', matches: /storageReserved/ },
    ],
    submit: (v) => api('POST', `/v1/nodes/${encodeURIComponent(node)}/disks`, {
      name: v.name, path: v.path, allowScheduling: v.allowScheduling, storageReserved: Number(v.storageReserved || 0),
    }),
  });
}

export async function render() {
  const nodes = await api('GET', '/v1/nodes');
  const area = notice();
  return h('section', {},
    heading('Nodes'),
    area,
    nodes.map((n) => h('article', { class: 'card' },
      h('div', { class: 'heading' }, h('h2', {}, n.name, ' ', badge(n.ready ? 'ready' : 'down')),
        h('div', { class: 'actions' }, h('button', { type: 'button', key: `add-disk-${n.name}`, onclick: () => addDisk(n.name) }, 'Add Disk'))),
      h('p', { class: 'help' }, `${n.address} · host ${n.host} · scheduling ${n.allowScheduling ? 'allowed' : 'disabled'} · heartbeat ${fmtTime(n.heartbeat)}`),
      table({
        rows: n.disks,
        rowKey: (d) => d.name,
        columns: [
          { label: 'Disk', cell: (d) => d.name },
          { label: 'Path', cell: (d) => h('code', {}, d.path), class: 'wide' },
          { label: 'Scheduling', cell: (d) => (d.allowScheduling ? 'allowed' : 'disabled') },
          { label: 'Available / Maximum', cell: (d) => `${fmtBytes(d.storageAvailable)} / ${fmtBytes(d.storageMaximum)}` },
          { label: 'Scheduled', cell: (d) => fmtBytes(d.storageScheduled) },
          { label: 'Reserved', cell: (d) => fmtBytes(d.storageReserved) },
          { label: 'Error', cell: (d) => (d.error ? badge('error', d.error) : '') },
          { label: 'Operation', cell: (d) => actionButton('Remove', area,
            () => api('DELETE', `/v1/nodes/${encodeURIComponent(n.name)}/disks/${encodeURIComponent(d.name)}`),
            { danger: true, key: `rm-${n.name}-${d.name}`, confirm: `Remove disk ${d.name} from node ${n.name}? Corral stops using it (the files stay).` }) },
        ],
      }))));
}
