// Recurring jobs: snapshot and backup tasks on a cron schedule over volumes by name or group.

import { api } from '../api.js';
import { actionButton, fmtTime, formDialog, h, heading, notice, table } from '../dom.js';

export const title = 'Recurring Jobs';
export const kinds = ['recurring-job'];

const list = (text) => text.split(',').map((s) => s.trim()).filter(Boolean);

function create() {
  return formDialog({
    title: 'Create Recurring Job',
    fields: [
      { name: 'name', label: 'Name', value: '', matches: /job name|recurring job ".*"|already exists/ },
      { name: 'task', label: 'Task', type: 'select', value: 'snapshot', options: [['snapshot', 'Snapshot'], ['backup', 'Backup']], matches: /task/ },
      { name: 'cron', label: 'Schedule (cron, UTC)', value: '0 * * * *', matches: /cron|schedule/i },
      { name: 'retain', label: 'Retain', type: 'number', value: '5', matches: /retain/ },
      { name: 'concurrency', label: 'Concurrency', type: 'number', value: '1', matches: /concurrency/ },
      { name: 'volumes', label: 'Volumes (comma-separated)', value: '', matches: /volume/ },
      { name: 'groups', label: 'Groups (comma-separated)', value: '', matches: /group/ },
    ],
    submit: (v) => api('POST', '/v1/recurringjobs', {
      name: v.name, task: v.task, cron: v.cron, retain: Number(v.retain), concurrency: Number(v.concurrency),
      volumes: list(v.volumes), groups: list(v.groups),
    }),
  });
}

export async function render() {
  const jobs = await api('GET', '/v1/recurringjobs');
  const area = notice();
  return h('section', {},
    heading('Recurring Jobs', h('button', { type: 'button', class: 'primary', key: 'create-job', onclick: create }, 'Create Recurring Job')),
    area,
    table({
      rows: jobs,
      rowKey: (j) => j.name,
      empty: 'No recurring jobs.',
      columns: [
        { label: 'Name', cell: (j) => j.name },
        { label: 'Task', cell: (j) => j.task },
        { label: 'Schedule', cell: (j) => h('code', {}, j.cron) },
        { label: 'Retain', cell: (j) => String(j.retain) },
        { label: 'Volumes / Groups', cell: (j) => [...j.volumes, ...j.groups.map((g) => `group:${g}`)].join(', ') },
        { label: 'Next run', cell: (j) => fmtTime(j.nextRun) },
        { label: 'Last results', cell: (j) => Object.entries(j.lastResults ?? {}).map(([k, r]) => `${k}: ${r}`).join('; ') },
        { label: 'Operation', cell: (j) => actionButton('Delete', area, () => api('DELETE', `/v1/recurringjobs/${encodeURIComponent(j.name)}`),
          { danger: true, key: `delete-${j.name}`, confirm: `Delete recurring job ${j.name}? What it made stays.` }) },
      ],
    }));
}
