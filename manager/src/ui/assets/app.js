// The application shell: a hash router over the page modules (one per page, each `{kinds, render(main, params)}`),
// and live refresh: a change of a kind the open page shows re-renders it (coalesced, at most ~4 times a second).

import { api, connectEvents, onChange, onUnauthorized, setToken, signOut, token } from './api.js';
import { h } from './dom.js';
import * as dashboard from './pages/dashboard.js';
import * as volumes from './pages/volumes.js';
import * as backingImages from './pages/backing_images.js';
import * as backups from './pages/backups.js';
import * as nodes from './pages/nodes.js';
import * as settings from './pages/settings.js';
import * as recurringJobs from './pages/recurring_jobs.js';

/** [pattern of the hash path, page module, render function name] */
const ROUTES = [
  [/^\/?$/, dashboard, 'render'],
  [/^\/volumes$/, volumes, 'renderList'],
  [/^\/volumes\/([^/]+)$/, volumes, 'renderDetail'],
  [/^\/backingimages$/, backingImages, 'renderList'],
  [/^\/backingimages\/([^/]+)$/, backingImages, 'renderDetail'],
  [/^\/backups$/, backups, 'render'],
  [/^\/nodes$/, nodes, 'render'],
  [/^\/settings$/, settings, 'render'],
  [/^\/recurringjobs$/, recurringJobs, 'render'],
];

let current = null;
let generation = 0;

function route() {
  const path = decodeURIComponent(location.hash.replace(/^#/, '')) || '/';
  for (const [re, mod, fn] of ROUTES) {
    const m = re.exec(path);
    if (m) return { mod, fn, params: m.slice(1), path };
  }
  return null;
}

async function show(fresh) {
  // Signed out (a refresh queued before Sign out fires after it): the sign-in page stays.
  if (!token()) return;
  const main = document.getElementById('page');
  const r = route();
  const gen = ++generation;
  if (!r) {
    main.replaceChildren(h('h1', {}, 'Not found'), h('p', {}, 'No page here. ', h('a', { href: '#/' }, 'Dashboard')));
    return;
  }
  current = r;
  for (const a of document.querySelectorAll('#nav a')) {
    const target = a.getAttribute('href').slice(1);
    const here = target === '/' ? r.path === '/' : r.path.startsWith(target);
    if (here) a.setAttribute('aria-current', 'page'); else a.removeAttribute('aria-current');
  }
  // Keep the focused control across a live re-render (buttons and links carry a data-key).
  const focusKey = document.activeElement?.dataset?.key;
  let content;
  try {
    content = await r.mod[r.fn](...r.params);
  } catch (e) {
    content = h('div', {}, h('h1', {}, 'Error'), h('p', { class: 'notice shown', role: 'alert' }, e.message));
  }
  if (gen !== generation) return; // a newer navigation or refresh won
  const keep = main.querySelector('.notice.shown');
  main.replaceChildren(content);
  if (keep && !fresh) {
    const area = main.querySelector('.notice');
    if (area) { area.replaceWith(keep); }
  }
  document.title = `${r.mod.title ?? 'Corral'} · Corral`;
  if (focusKey && !fresh) main.querySelector(`[data-key="${CSS.escape(focusKey)}"]`)?.focus();
  if (fresh) main.focus({ preventScroll: true });
  main.dataset.rendered = String(gen);
  // Time to the first rendered content (read by the page-weight test).
  if (!performance.getEntriesByName('corral-rendered').length) performance.mark('corral-rendered');
}

let pending = null;
function refreshSoon() {
  if (pending) return;
  pending = setTimeout(() => { pending = null; show(false); }, 250);
}

onChange((kind) => {
  if (!current) return;
  if (kind === '' || (current.mod.kinds ?? []).includes(kind)) refreshSoon();
});

let feed = null;
function startFeed() {
  feed?.close();
  feed = connectEvents((state) => {
    const live = document.getElementById('live');
    live.textContent = state;
    live.dataset.state = state;
    if (state === 'live') refreshSoon(); // catch up on what changed while disconnected
  });
}

/** The sign-in page: the token is checked against the API, then kept in this tab's sessionStorage only. */
function showSignIn(message) {
  feed?.close();
  feed = null;
  generation += 1; // a render under way must not replace this page
  current = null;
  clearTimeout(pending);
  pending = null;
  document.getElementById('signout').hidden = true;
  const main = document.getElementById('page');
  const input = h('input', {
    id: 'token', name: 'token', type: 'password', autocomplete: 'off', required: true,
    'aria-describedby': 'signin-error',
  });
  const error = h('p', { id: 'signin-error', class: message ? 'notice shown' : 'notice', role: 'alert' }, message ?? '');
  const form = h('form', {
    id: 'signin',
    onsubmit: async (e) => {
      e.preventDefault();
      setToken(input.value.trim());
      try {
        await api('GET', '/v1/nodes');
      } catch (err) {
        signOut();
        showSignIn(err.status === 401 ? 'That token is unknown or revoked.' : err.message);
        return;
      }
      signedIn();
    },
  },
  h('label', { for: 'token' }, 'API token'), input,
  h('p', { class: 'hint' }, 'corral token create NAME --role viewer makes one; the first admin token is in the '
    + "manager's data directory (admin.token). It is kept in this tab only."),
  h('button', { type: 'submit' }, 'Sign in'), error);
  main.replaceChildren(h('h1', {}, 'Sign in'), form);
  document.title = 'Sign in · Corral';
  main.dataset.rendered = 'signin';
  input.focus();
}

function signedIn() {
  document.getElementById('signout').hidden = false;
  startFeed();
  show(true);
}

onUnauthorized(() => { if (document.getElementById('signin') === null) { signOut(); showSignIn('Signed out: sign in again.'); } });
document.getElementById('signout').addEventListener('click', () => { signOut(); showSignIn(); });
window.addEventListener('hashchange', () => { if (token()) show(true); });
if (token()) signedIn(); else showSignIn();
