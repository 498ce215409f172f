// Dashboard: nodes, disks with capacity and scheduling, volumes by robustness.

import { api } from '../api.js';
import { badge, fmtBytes, h, heading, table } from '../dom.js';

export const title = 'Dashboard';
export const kinds = ['node', 'volume'];

export async function render() {
  const [nodes, vols] = await Promise.all([api('GET', '/v1/nodes'), api('GET', '/v1/volumes')]);
  const count = (f) => vols.filter(f).length;
  const disks = nodes.flatMap((n) => n.disks);
  const sum = (k) => disks.reduce((a, d) => a + (d[k] ?? 0), 0);
  const tile = (label, value, cls) => h('div', { class: `tile ${cls ?? ''}` }, h('span', { class: 'num' }, String(value)), h('span', {}, label));
  return h('section', {},
    heading('Dashboard'),
    h('h2', {}, 'Volumes'),
    h('div', { class: 'tiles' },
      tile('healthy', count((v) => v.robustness === 'healthy'), 'good'),
      tile('degraded', count((v) => v.robustness === 'degraded'), 'busy'),
      tile('faulted', count((v) => v.robustness === 'faulted'), 'bad'),
      tile('detached', count((v) => v.state === 'detached'))),
    h('h2', {}, 'Nodes'),
    h('div', { class: 'tiles' },
      tile('ready', nodes.filter((n) => n.ready).length, 'good'),
      tile('down', nodes.filter((n) => !n.ready).length, 'bad'),
      tile('schedulable disks', disks.filter((d) => d.allowScheduling).length)),
    h('h2', {}, 'Storage'),
    h('div', { class: 'tiles' },
      tile('maximum', fmtBytes(sum('storageMaximum'))),
      tile('available', fmtBytes(sum('storageAvailable'))),
      tile('scheduled', fmtBytes(sum('storageScheduled')))),
    table({
      rows: nodes,
      rowKey: (n) => n.name,
      columns: [
        { label: 'Node', cell: (n) => h('a', { href: '#/nodes' }, n.name) },
        { label: 'Ready', cell: (n) => badge(n.ready ? 'ready' : 'down') },
        { label: 'Disks', cell: (n) => String(n.disks.length) },
        { label: 'Available', cell: (n) => fmtBytes(n.disks.reduce((a, d) => a + d.storageAvailable, 0)) },
      ],
    }));
}
