//! The web UI in a real browser: Debian's `chromium`, driven headless through `chromedriver` (WebDriver is HTTP and
//! JSON: the calls go through curl like the other REST calls of these tests), against a real `corral-manager` with
//! real daemons. From the pages: a volume is created, attached and seen healthy as the store's watch streams its
//! progress in (no reload); a volume form is filled and submitted with the keyboard alone; bad input (an empty name,
//! a size that is not a multiple of 4096, a checksum of the wrong length, a URL that is not http(s)) shows the API's
//! message next to its field and creates nothing; a qcow2 made by `qemu-img` is uploaded as a backing image and
//! becomes ready with the file's SHA-512; Delete is disabled for an image a volume uses; two unused images are
//! deleted in one batch after a confirmation; a volume created from the page on that image reads its data; at 390 px
//! the layout is checked by element positions. A second test: a failed download's unavailable icon and message, a
//! restore with "Use previous backing image", a DR volume activated, a snapshot clone, a rebuild followed live. A
//! third: sign-in with a wrong token, sign-in, the token kept in the tab only, Sign out, a revoked token signed out.
//! Every page is photographed at 1280×800 and 390×844 into `target/tmp/ui-screenshots/` (copies are committed in
//! `docs/ui/`).
//!
//! Run alone: `cargo nextest run -p manager --test ui` (build the binaries first). Without chromium and
//! chromedriver (Debian `chromium`, `chromium-driver`) the test is skipped with the reason, unless `CI` is set:
//! then it fails.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{Value, json};
use support::*;
use testkit::{Daemon, DaemonCommand, kill_under, wait_for};

/// Each wait of the test for the page; the volume's attach and the upload take a few seconds on an idle machine.
const PAGE: Duration = Duration::from_secs(20);
const HEALTHY: Duration = Duration::from_secs(60);

/// The WebDriver element reference key (W3C).
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// A headless chromium session through chromedriver. Dropping it ends the session (chromium exits), then kills
/// chromedriver and anything left that mentions the session's profile directory.
struct Browser {
    session: String,
    driver: Daemon,
    profile: tempfile::TempDir,
}

impl Browser {
    fn start() -> Browser {
        let profile = tempfile::Builder::new()
            .prefix("corral-ui-chromium-")
            .tempdir()
            .unwrap();
        let driver = testkit::ports::retry_on_address_in_use(|| {
            let port = testkit::ports::unbound_port();
            DaemonCommand::new("chromedriver")
                .arg(format!("--port={port}"))
                .listening_on("http", format!("127.0.0.1:{port}"))
                .try_spawn()
        });
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {"args": [
                "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                format!("--user-data-dir={}", profile.path().display()),
            ]}
        }}});
        let (code, v) = rest(
            "POST",
            &format!("{}/session", driver.http_url("http")),
            Some(&caps),
        );
        assert_eq!(code, 200, "new WebDriver session: {v}");
        let session = v["value"]["sessionId"].as_str().expect("sessionId").to_owned();
        Browser {
            session,
            driver,
            profile,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("{}/session/{}{path}", self.driver.http_url("http"), self.session)
    }

    /// A WebDriver command; Err carries the driver's error name and message.
    fn try_cmd(&self, method: &str, path: &str, body: Option<&Value>) -> Result<Value, String> {
        let (code, v) = rest(method, &self.url(path), body);
        if code == 200 {
            Ok(v["value"].clone())
        } else {
            Err(format!("{} {}", v["value"]["error"], v["value"]["message"]))
        }
    }

    fn cmd(&self, method: &str, path: &str, body: Option<&Value>) -> Value {
        self.try_cmd(method, path, body)
            .unwrap_or_else(|e| panic!("WebDriver {method} {path}: {e}"))
    }

    fn js(&self, script: &str, args: &[Value]) -> Value {
        self.cmd(
            "POST",
            "/execute/sync",
            Some(&json!({"script": script, "args": args})),
        )
    }

    /// Sets the viewport (what the page sees as innerWidth × innerHeight) to `width` × `height`: the window is
    /// set, then made taller by what its frame takes (headless chromium's frame has no width).
    fn resize(&self, width: i64, height: i64) {
        let rect = |h: i64| {
            self.cmd(
                "POST",
                "/window/rect",
                Some(&json!({"width": width, "height": h})),
            );
        };
        rect(height);
        let frame = self
            .js("return outerHeight - innerHeight", &[])
            .as_i64()
            .unwrap_or(0);
        if frame > 0 {
            rect(height + frame);
        }
        let got = self.js("return [innerWidth, innerHeight]", &[]);
        assert_eq!(got, json!([width, height]), "viewport");
    }

    /// Opens `url` and waits until the page rendered its content (the shell marks `main` after each render). A tab
    /// without a token shows the sign-in page first: the admin token is typed into it, as a user does.
    fn open(&self, url: &str) {
        self.cmd("POST", "/url", Some(&json!({ "url": url })));
        self.wait_rendered();
        if self.rendered() == "signin" {
            self.sign_in(&admin_token().expect("the manager's admin token"));
        }
    }

    fn rendered(&self) -> String {
        self.js(
            "return document.getElementById('page')?.dataset.rendered ?? ''",
            &[],
        )
        .as_str()
        .unwrap_or_default()
        .to_owned()
    }

    /// Types `token` into the sign-in page and submits it; waits until a page other than sign-in rendered.
    fn sign_in(&self, token: &str) {
        self.fill("#token", token);
        self.click("#signin button[type=submit]");
        wait_for("signed in", PAGE, || {
            let r = self.rendered();
            (!r.is_empty() && r != "signin").then_some(())
        });
    }

    /// Navigates inside the application (a hash change, no reload) and waits for the new page's render.
    fn go(&self, hash: &str) {
        let before = self.js(
            "return document.getElementById('page').dataset.rendered ?? ''",
            &[],
        );
        self.js("location.hash = arguments[0]", &[json!(hash)]);
        wait_for(&format!("page {hash} rendered"), PAGE, || {
            let now = self.js(
                "return location.hash === arguments[0] ? (document.getElementById('page').dataset.rendered ?? '') : null",
                &[json!(hash)],
            );
            (!now.is_null() && now != before).then_some(())
        });
    }

    fn wait_rendered(&self) {
        wait_for("page rendered", PAGE, || {
            self.js(
                "return document.getElementById('page')?.dataset.rendered ?? null",
                &[],
            )
            .as_str()
            .map(|_| ())
        });
    }

    fn find(&self, css: &str) -> Option<String> {
        self.try_cmd(
            "POST",
            "/element",
            Some(&json!({"using": "css selector", "value": css})),
        )
        .ok()
        .and_then(|v| v[ELEMENT].as_str().map(str::to_owned))
    }

    /// Clicks the element `css` selects once it exists and is enabled; a live re-render that replaced it between
    /// finding and clicking is retried.
    fn click(&self, css: &str) {
        wait_for(&format!("{css} clickable"), PAGE, || {
            let enabled = self.js(
                "const e = document.querySelector(arguments[0]); return !!e && !e.disabled",
                &[json!(css)],
            );
            if enabled != json!(true) {
                return None;
            }
            let id = self.find(css)?;
            self.try_cmd("POST", &format!("/element/{id}/click"), Some(&json!({})))
                .ok()
                .map(|_| ())
        });
    }

    /// Types `text` into the field `css` (emptied first) with WebDriver key events.
    /// A field the page re-rendered between finding and typing ("stale element reference") is found again and
    /// filled anew; any other driver error fails the test.
    fn fill(&self, css: &str, text: &str) {
        wait_for(&format!("field {css} filled"), PAGE, || {
            let id = self.find(css)?;
            let typed = self
                .try_cmd("POST", &format!("/element/{id}/clear"), Some(&json!({})))
                .and_then(|_| {
                    self.try_cmd(
                        "POST",
                        &format!("/element/{id}/value"),
                        Some(&json!({ "text": text })),
                    )
                });
            match typed {
                Ok(_) => Some(()),
                Err(e) if e.contains("stale element") => None,
                Err(e) => panic!("WebDriver fill {css}: {e}"),
            }
        });
    }

    /// Presses keys on whatever has the focus (W3C actions: key down and up for each).
    fn keys(&self, keys: &[&str]) {
        let mut actions = Vec::new();
        for k in keys {
            actions.push(json!({"type": "keyDown", "value": k}));
            actions.push(json!({"type": "keyUp", "value": k}));
        }
        self.cmd(
            "POST",
            "/actions",
            Some(&json!({"actions": [{"type": "key", "id": "keyboard", "actions": actions}]})),
        );
    }

    /// Presses `keys` together (the first ones held while the next go down), e.g. Control+A.
    fn chord(&self, keys: &[&str]) {
        let mut actions: Vec<Value> = keys
            .iter()
            .map(|k| json!({"type": "keyDown", "value": k}))
            .collect();
        actions.extend(keys.iter().rev().map(|k| json!({"type": "keyUp", "value": k})));
        self.cmd(
            "POST",
            "/actions",
            Some(&json!({"actions": [{"type": "key", "id": "keyboard", "actions": actions}]})),
        );
    }

    fn typing(&self, text: &str) {
        let chars: Vec<String> = text.chars().map(String::from).collect();
        self.keys(&chars.iter().map(String::as_str).collect::<Vec<_>>());
    }

    fn text(&self, css: &str) -> Option<String> {
        self.js(
            "return document.querySelector(arguments[0])?.textContent ?? null",
            &[json!(css)],
        )
        .as_str()
        .map(str::to_owned)
    }

    /// Waits until the element `css` exists and its text satisfies `ok`; returns the text.
    fn wait_text(&self, css: &str, what: &str, timeout: Duration, ok: impl Fn(&str) -> bool) -> String {
        wait_for(what, timeout, || self.text(css).filter(|t| ok(t)))
    }

    fn screenshot(&self, path: &Path) {
        let b64 = self.cmd("GET", "/screenshot", None);
        let mut child = Command::new("base64")
            .args(["-d"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::fs::File::create(path).unwrap())
            .spawn()
            .expect("base64");
        use std::io::Write;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(b64.as_str().expect("screenshot base64").as_bytes())
            .unwrap();
        assert!(child.wait().unwrap().success(), "decode {}", path.display());
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.try_cmd("DELETE", "", None);
        self.driver.kill();
        kill_under(self.profile.path());
    }
}

/// Why the browser cannot run here, if it cannot.
fn browser_missing() -> Option<String> {
    for tool in ["chromium", "chromedriver"] {
        let found = Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .output()
            .is_ok_and(|o| o.status.success());
        if !found {
            return Some(format!(
                "{tool} is not installed (Debian packages chromium, chromium-driver)"
            ));
        }
    }
    None
}

fn api_names(m: &Manager, path: &str) -> Vec<String> {
    let (code, v) = rest("GET", &format!("{}{path}", m.url), None);
    assert_eq!(code, 200, "{v}");
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x["name"].as_str().unwrap().to_owned())
        .collect()
}

/// Backing images not being deleted.
fn live_images(m: &Manager) -> Vec<String> {
    let (code, v) = rest("GET", &format!("{}/v1/backingimages", m.url), None);
    assert_eq!(code, 200, "{v}");
    v.as_array()
        .unwrap()
        .iter()
        .filter(|x| x["deletionTimestamp"].is_null())
        .map(|x| x["name"].as_str().unwrap().to_owned())
        .collect()
}

/// The field error shown under `field` of the open form, once there is one.
fn field_error(b: &Browser, field: &str) -> String {
    b.wait_text(
        &format!("#f-{field}-error"),
        &format!("an error under {field}"),
        PAGE,
        |t| !t.is_empty(),
    )
}

fn shots_dir() -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join("ui-screenshots");
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A qcow2 of 32 MiB virtual size with 1 MiB of a pattern, made by qemu-img and qemu-io.
fn qcow2_fixture(dir: &Path) -> PathBuf {
    let path = dir.join("upload.qcow2");
    let ok = Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2"])
        .arg(&path)
        .arg("32M")
        .status()
        .unwrap()
        .success();
    assert!(ok, "qemu-img create");
    let out = Command::new("qemu-io")
        .args(["-f", "qcow2", "-c", "write -P 0x5a 1M 1M"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(out.status.success(), "qemu-io: {out:?}");
    path
}

#[test]
fn ui_drives_volumes_and_backing_images_in_chromium() {
    if let Some(why) = browser_missing() {
        assert!(std::env::var_os("CI").is_none(), "CI must run the UI test: {why}");
        eprintln!("skipped: {why}");
        return;
    }
    let dir = testkit::disk_tempdir("corral-ui-");
    let m = Manager::start(&dir.path().join("n1"), "n1", "embedded", port_range(0));
    let b = Browser::start();
    b.resize(1280, 800);
    b.open(&format!("{}/#/volumes", m.url));
    let shots = shots_dir();
    // The files come gzipped (compressed at build time) to a browser that takes gzip.
    let gz = b.js(
        "return performance.getEntriesByType('resource').filter((e) => e.name.includes('/ui/') && e.name.endsWith('.js')).map((e) => [e.encodedBodySize, e.decodedBodySize])",
        &[],
    );
    let gz = gz.as_array().unwrap();
    assert!(!gz.is_empty(), "the page loaded its modules");
    for pair in gz {
        assert!(
            pair[0].as_u64() < pair[1].as_u64(),
            "a module came compressed: {gz:?}"
        );
    }

    // Bad input: the API's message under the field that caused it, and nothing created.
    b.click("[data-key=create-volume]");
    b.fill("#f-name", "");
    b.fill("#f-size", "5000");
    b.click("dialog button[type=submit]");
    let e = field_error(&b, "name");
    assert!(e.contains("volume name \"\" is not a valid name"), "{e}");
    b.fill("#f-name", "bad");
    b.click("dialog button[type=submit]");
    let e = field_error(&b, "size");
    assert!(e.contains("size 5000 is not a positive multiple of 4096"), "{e}");
    assert_eq!(
        b.text("#f-name-error").as_deref(),
        Some(""),
        "the name's error went with the name's fix"
    );
    // The v2 data engine on a node without a v2 disk: the placement refusal under the engine's field.
    b.fill("#f-name", "bad");
    b.fill("#f-size", "64 MiB");
    choose(&b, "#f-dataEngine", "v2");
    b.click("dialog button[type=submit]");
    let e = field_error(&b, "dataEngine");
    assert!(e.contains("v2 disk"), "{e}");
    b.screenshot(&shots.join("volume-create-error-1280.png"));
    choose(&b, "#f-dataEngine", "");
    assert!(
        api_names(&m, "/v1/volumes").is_empty(),
        "bad input created nothing"
    );

    // A volume created from the page, attached from its page, healthy as the watch streams it in: no reload.
    b.fill("#f-name", "web1");
    b.fill("#f-size", "64 MiB");
    b.click("dialog button[type=submit]");
    wait_for("the volume's page", PAGE, || {
        (b.js("return location.hash", &[]) == json!("#/volumes/web1")).then_some(())
    });
    b.wait_rendered();
    assert_eq!(volume(&m, "web1")["size"], json!(64 << 20));
    b.js("window.__sameDocument = true", &[]);
    b.click("[data-key=attach-web1]");
    b.wait_text("dl.facts", "web1 healthy on its page", HEALTHY, |t| {
        t.contains("healthy") && t.contains("nbd+unix://")
    });
    assert_eq!(
        b.js("return window.__sameDocument === true", &[]),
        json!(true),
        "the page was not reloaded"
    );
    assert_eq!(volume(&m, "web1")["robustness"], "healthy");
    b.wait_text("[data-label=Mode]", "the replica in RW", PAGE, |t| t == "RW");
    b.click("[data-key=take-snapshot]");
    let snap = b.wait_text("[data-row] .tree", "the snapshot listed", PAGE, |t| !t.is_empty());
    let (code, snaps) = rest("GET", &format!("{}/v1/volumes/web1/snapshots", m.url), None);
    assert_eq!(code, 200, "{snaps}");
    assert!(snaps.to_string().contains(&snap), "{snap} in {snaps}");

    // One form with the keyboard alone: Tab to "Create Volume", Enter, type, Tab, type, Enter.
    b.go("#/volumes");
    wait_for("Create Volume focused by Tab", PAGE, || {
        b.keys(&["\u{E004}"]);
        (b.js("return document.activeElement?.dataset.key ?? ''", &[]) == json!("create-volume"))
            .then_some(())
    });
    b.keys(&["\u{E007}"]);
    wait_for("the name field focused", PAGE, || {
        (b.js("return document.activeElement?.id", &[]) == json!("f-name")).then_some(())
    });
    b.typing("kbd1");
    b.keys(&["\u{E004}"]);
    assert_eq!(b.js("return document.activeElement?.id", &[]), json!("f-size"));
    b.chord(&["\u{E009}", "a"]);
    b.typing("32 MiB");
    b.keys(&["\u{E007}"]);
    wait_for("kbd1 created by keyboard", PAGE, || {
        (b.js("return location.hash", &[]) == json!("#/volumes/kbd1")).then_some(())
    });
    assert_eq!(volume(&m, "kbd1")["size"], json!(32 << 20));

    // Backing images: bad input refused at its field, then an upload of a qcow2 that becomes ready.
    let qcow2 = qcow2_fixture(dir.path());
    b.go("#/backingimages");
    b.click("[data-key=create-bi]");
    b.fill("#f-name", "bi-bad");
    b.fill("#f-url", "ftp://example.invalid/x.img");
    b.click("dialog button[type=submit]");
    let e = field_error(&b, "url");
    assert!(e.contains("url"), "{e}");
    b.fill("#f-url", "http://127.0.0.1:9/x.img");
    b.fill("#f-expectedChecksum", "abc");
    b.click("dialog button[type=submit]");
    let e = field_error(&b, "expectedChecksum");
    assert!(e.contains("128 hex digits"), "{e}");
    assert!(
        api_names(&m, "/v1/backingimages").is_empty(),
        "bad input created nothing"
    );
    b.fill("#f-expectedChecksum", "");
    b.fill("#f-name", "bi-up");
    b.click("#f-sourceType option[value=upload]");
    b.js(
        "document.getElementById('f-sourceType').dispatchEvent(new Event('change'))",
        &[],
    );
    let file = wait_for("the file field", PAGE, || b.find("#f-file"));
    b.cmd(
        "POST",
        &format!("/element/{file}/value"),
        Some(&json!({"text": qcow2.display().to_string()})),
    );
    b.click("dialog button[type=submit]");
    wait_for("the image's page", HEALTHY, || {
        (b.js("return location.hash", &[]) == json!("#/backingimages/bi-up")).then_some(())
    });
    let facts = b.wait_text("dl.facts", "bi-up ready", HEALTHY, |t| {
        t.contains("Current SHA512 Checksum") && t.contains("ready")
    });
    let sha = testkit::sha512_file(&qcow2);
    assert!(
        facts.contains(&sha),
        "the page shows the file's SHA-512 {sha}: {facts}"
    );
    b.wait_text("[data-label=State] .badge", "the disk file ready", PAGE, |t| {
        t == "ready"
    });

    // A volume created from the page on the uploaded image, attached there, healthy, reads the image's data.
    b.go("#/volumes");
    b.click("[data-key=create-volume]");
    b.fill("#f-name", "on-bi");
    b.fill("#f-size", "64 MiB");
    choose(&b, "#f-backingImage", "bi-up");
    b.click("dialog button[type=submit]");
    wait_for("on-bi's page", PAGE, || {
        (b.js("return location.hash", &[]) == json!("#/volumes/on-bi")).then_some(())
    });
    b.wait_rendered();
    assert_eq!(volume(&m, "on-bi")["backingImage"], "bi-up");
    b.click("[data-key=attach-on-bi]");
    b.wait_text("dl.facts", "on-bi healthy on its page", HEALTHY, |t| {
        t.contains("healthy") && t.contains("nbd+unix://")
    });
    reads_image_data(&unix_endpoint(&volume(&m, "on-bi")));

    // Delete disabled while a volume uses the image; two unused ones deleted in one batch, after a confirmation.
    for name in ["unused-1", "unused-2"] {
        let (code, v) = rest(
            "POST",
            &format!("{}/v1/backingimages", m.url),
            Some(&json!({"name": name, "sourceType": "upload"})),
        );
        assert_eq!(code, 201, "{v}");
    }
    b.go("#/backingimages");
    b.wait_text("table", "three images listed", PAGE, |t| {
        t.contains("unused-2") && t.contains("bi-up")
    });
    assert_eq!(
        b.js(
            "return document.querySelector('[data-key=\"delete-bi-up\"]').disabled",
            &[]
        ),
        json!(true),
        "Delete is disabled for an image a volume uses"
    );
    b.click("[data-key=pick-unused-1]");
    b.click("[data-key=pick-unused-2]");
    b.click("[data-key=batch-delete]");
    let q = b.wait_text("dialog p", "the confirmation", PAGE, |t| t.contains("Delete 2"));
    assert!(q.contains("unused-1") && q.contains("unused-2"), "{q}");
    b.click("dialog form.confirm button[type=submit]");
    // Their files go in the background: the API lists them as deleting until then.
    wait_for("both unused images deleted", HEALTHY, || {
        (live_images(&m) == ["bi-up"]).then_some(())
    });

    // A backup target, a backup of web1 and a recurring job, so that their pages show rows; the backup's Restore
    // opens the restore form.
    let target = dir.path().join("backups");
    std::fs::create_dir_all(&target).unwrap();
    let (code, v) = rest(
        "PUT",
        &format!("{}/v1/backuptargets/default", m.url),
        Some(&json!({"url": format!("file://{}", target.display())})),
    );
    assert_eq!(code, 200, "{v}");
    let (code, v) = rest(
        "POST",
        &format!("{}/v1/backups", m.url),
        Some(&json!({"volume": "web1"})),
    );
    assert!(code == 200 || code == 201, "{v}");
    let (code, v) = rest(
        "POST",
        &format!("{}/v1/recurringjobs", m.url),
        Some(
            &json!({"name": "hourly", "task": "snapshot", "cron": "0 * * * *", "retain": 3, "volumes": ["web1"]}),
        ),
    );
    assert_eq!(code, 201, "{v}");
    b.go("#/backups");
    b.wait_text("body", "the backup completed on the page", HEALTHY, |t| {
        t.contains("completed")
    });
    b.click("[data-key^='restore-']");
    b.wait_text("dialog", "the restore form", PAGE, |t| {
        t.contains("New volume name")
    });
    b.screenshot(&shots.join("backup-restore-1280.png"));
    b.click("dialog button[type=button]");

    // Every page at both sizes; at 390 px the layout is checked by element positions.
    let pages = [
        ("dashboard", "#/"),
        ("volumes", "#/volumes"),
        ("volume-detail", "#/volumes/web1"),
        ("backing-images", "#/backingimages"),
        ("backing-image-detail", "#/backingimages/bi-up"),
        ("backups", "#/backups"),
        ("nodes", "#/nodes"),
        ("recurring-jobs", "#/recurringjobs"),
        ("settings", "#/settings"),
    ];
    for (w, h) in [(1280, 800), (390, 844)] {
        b.resize(w, h);
        for (name, hash) in pages {
            b.go(hash);
            b.screenshot(&shots.join(format!("{name}-{w}.png")));
            if w == 390 {
                narrow_layout_fits(&b, name);
            }
        }
    }
    b.go("#/volumes");
    b.click("[data-key=create-volume]");
    b.screenshot(&shots.join("volume-create-390.png"));
    let fits = b.js(
        "const r = document.getElementById('dialog').getBoundingClientRect(); return r.left >= 0 && r.right <= innerWidth",
        &[],
    );
    assert_eq!(fits, json!(true), "the create form fits a 390 px screen");
    eprintln!("screenshots in {}", shots.display());
}

/// Sign-in and sign-out as a user meets them, from a tab that holds no token: a token the cluster does not know is
/// refused on the sign-in page and nothing is kept; a viewer's token signs in, lives in this tab's sessionStorage
/// only (no localStorage, no cookie) and is never shown on the page; Sign out forgets it and a reload stays on the
/// sign-in page; a token revoked while signed in sends the next page back to sign-in with the reason.
#[test]
fn ui_signs_in_and_out_and_keeps_the_token_in_the_tab_only() {
    if let Some(why) = browser_missing() {
        assert!(std::env::var_os("CI").is_none(), "CI must run the UI test: {why}");
        eprintln!("skipped: {why}");
        return;
    }
    let dir = testkit::disk_tempdir("corral-ui-auth-");
    let m = Manager::start(&dir.path().join("n1"), "n1", "embedded", port_range(0));
    let b = Browser::start();
    let kept = "return [sessionStorage.getItem('corral-token'), localStorage.length, document.cookie]";
    let visit = |hash: &str| {
        b.cmd(
            "POST",
            "/url",
            Some(&json!({ "url": format!("{}/{hash}", m.url) })),
        );
        b.wait_rendered();
    };
    visit("#/volumes");
    assert_eq!(b.rendered(), "signin", "a tab without a token starts on sign-in");
    assert_eq!(b.js(kept, &[]), json!([null, 0, ""]));

    b.fill("#token", "corral-not-a-token-of-this-cluster-0123456789");
    b.click("#signin button[type=submit]");
    let e = b.wait_text("#signin-error", "the refusal", PAGE, |t| !t.is_empty());
    assert_eq!(e, "That token is unknown or revoked.");
    assert_eq!(b.rendered(), "signin");
    assert_eq!(
        b.js(kept, &[]),
        json!([null, 0, ""]),
        "a refused token is not kept"
    );

    let (code, v) = rest(
        "POST",
        &format!("{}/v1/tokens", m.url),
        Some(&json!({"name": "ui-viewer", "role": "viewer"})),
    );
    assert_eq!(code, 201, "{v}");
    let viewer = v["token"].as_str().unwrap().to_owned();
    b.sign_in(&viewer);
    assert_eq!(
        b.js(kept, &[]),
        json!([viewer, 0, ""]),
        "the token in sessionStorage only"
    );
    let shown = b.js(
        "return document.documentElement.outerHTML.includes(arguments[0])",
        &[json!(viewer)],
    );
    assert_eq!(shown, json!(false), "the token is never on the page");
    assert_eq!(
        b.js("return document.getElementById('signout').hidden", &[]),
        json!(false)
    );

    b.click("#signout");
    wait_for("the sign-in page after Sign out", PAGE, || {
        (b.rendered() == "signin").then_some(())
    });
    assert_eq!(
        b.js(kept, &[]),
        json!([null, 0, ""]),
        "Sign out forgets the token"
    );
    visit("#/nodes");
    assert_eq!(b.rendered(), "signin", "a reload after Sign out stays signed out");

    b.sign_in(&viewer);
    let (code, v) = rest("DELETE", &format!("{}/v1/tokens/ui-viewer", m.url), None);
    assert!(code == 200 || code == 204, "revoke: {code} {v}");
    b.js("location.hash = '#/volumes'; return null", &[]);
    let e = b.wait_text("#signin-error", "the revoked token's sign-out", PAGE, |t| {
        !t.is_empty()
    });
    assert_eq!(e, "Signed out: sign in again.");
    assert_eq!(
        b.js(kept, &[]),
        json!([null, 0, ""]),
        "a revoked token is forgotten"
    );
}

/// Picks `value` in the select `css` as a user does (the change event included).
fn choose(b: &Browser, css: &str, value: &str) {
    wait_for(&format!("{css} on the page"), PAGE, || b.find(css));
    let got = b.js(
        "const e = document.querySelector(arguments[0]); e.value = arguments[1]; e.dispatchEvent(new Event('change')); return e.value",
        &[json!(css), json!(value)],
    );
    assert_eq!(got, json!(value), "{css} has an option {value}");
}

/// The qcow2 fixture's data through a volume's NBD endpoint: its pattern at 1 MiB, zeros before it.
fn reads_image_data(uri: &str) {
    let (ok, out) = testkit::nbd::qemu_io(uri, &["read -P 0x5a 1M 1M", "read -P 0 0 1M"]);
    assert!(ok, "the image's data through {uri}: {out}");
}

/// Waits until the page's location is `hash` and the page rendered.
fn wait_hash(b: &Browser, hash: &str) {
    wait_for(&format!("page {hash}"), PAGE, || {
        (b.js("return location.hash", &[]) == json!(hash)).then_some(())
    });
    b.wait_rendered();
}

/// A loopback HTTP server answering every request 404 (a download URL whose file is gone); lives as long as the
/// test process.
fn not_found_server() -> std::net::SocketAddr {
    use std::io::{Read, Write};
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for mut c in l.incoming().flatten() {
            let mut buf = [0u8; 4096];
            let _ = c.read(&mut buf);
            let _ = c.write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        }
    });
    addr
}

/// A restore's record through the API (`GET /v1/volumes/{name}/restore`).
fn restore_of(m: &Manager, name: &str) -> Value {
    let (code, v) = rest("GET", &format!("{}/v1/volumes/{name}/restore", m.url), None);
    assert_eq!(code, 200, "{v}");
    v
}

/// From the pages, on a backing image uploaded through the API (the page's upload is the first test's): a download
/// from an unreachable port shows the unavailable icon with the message; a backup of a volume on the image,
/// restored from the backups page with "Use previous backing image" (checked by default), gives a volume on the
/// image that reads its data; a DR (standby) volume made from the backup volume's row is activated on its page; a
/// clone of a snapshot from the volume's page (a missing snapshot's message under its field first) completes; a
/// SIGKILLed replica's rebuild is followed on the volume's page with no reload.
#[test]
fn ui_restores_clones_and_shows_failed_downloads_in_chromium() {
    if let Some(why) = browser_missing() {
        assert!(std::env::var_os("CI").is_none(), "CI must run the UI test: {why}");
        eprintln!("skipped: {why}");
        return;
    }
    let dir = testkit::disk_tempdir("corral-ui2-");
    let m = Manager::start(&dir.path().join("n1"), "n1", "embedded", port_range(1));
    let b = Browser::start();
    b.resize(1280, 800);
    b.open(&format!("{}/#/backingimages", m.url));
    let shots = shots_dir();

    // A download of a URL that 404s: unavailable, with the reason as the icon's tooltip. (A port nobody listens on
    // is retried as a stalled download, in progress, not failed.)
    let missing = not_found_server();
    b.click("[data-key=create-bi]");
    b.fill("#f-name", "bi-gone");
    b.fill("#f-url", &format!("http://{missing}/gone.img"));
    b.click("dialog button[type=submit]");
    wait_hash(&b, "#/backingimages/bi-gone");
    b.go("#/backingimages");
    let tip = wait_for("the unavailable icon", HEALTHY, || {
        b.js(
            "return document.querySelector('[data-key=\"unavailable-bi-gone\"]')?.title ?? null",
            &[],
        )
        .as_str()
        .map(str::to_owned)
    });
    let (code, gone) = rest("GET", &format!("{}/v1/backingimages/bi-gone", m.url), None);
    assert_eq!(code, 200, "{gone}");
    let disk_message = gone["disks"][0]["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(!disk_message.is_empty(), "the failed copy says why: {gone}");
    assert!(
        tip.starts_with("Unavailable") && tip.contains(&disk_message),
        "the icon's tooltip carries the message {disk_message:?}: {tip:?}"
    );
    b.screenshot(&shots.join("backing-images-unavailable-1280.png"));
    b.go("#/backingimages/bi-gone");
    b.wait_text(
        "[data-label=Message]",
        "the message as text on the detail page",
        PAGE,
        |t| t.contains(&disk_message),
    );

    // An image uploaded through the API, a volume on it with data, backed up to a file:// target.
    let qcow2 = qcow2_fixture(dir.path());
    let (code, v) = rest(
        "POST",
        &format!("{}/v1/backingimages", m.url),
        Some(&json!({"name": "bi-up", "sourceType": "upload"})),
    );
    assert_eq!(code, 201, "{v}");
    let out = curl_command()
        .args(["-sS", "-o", "/dev/null", "-w", "%{http_code}", "-F"])
        .arg(format!("file=@{}", qcow2.display()))
        .arg(format!(
            "{}/v1/backingimages/bi-up/upload?size={}",
            m.url,
            std::fs::metadata(&qcow2).unwrap().len()
        ))
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&out.stdout).starts_with('2'),
        "upload: {out:?}"
    );
    let (code, v) = rest(
        "POST",
        &format!("{}/v1/volumes", m.url),
        Some(&json!({"name": "src", "size": 64 << 20, "numberOfReplicas": 1, "backingImage": "bi-up"})),
    );
    assert_eq!(code, 201, "{v}");
    attach(&m.url, "src");
    let target = dir.path().join("backups");
    std::fs::create_dir_all(&target).unwrap();
    let (code, v) = rest(
        "PUT",
        &format!("{}/v1/backuptargets/default", m.url),
        Some(&json!({"url": format!("file://{}", target.display())})),
    );
    assert_eq!(code, 200, "{v}");
    let (code, v) = rest(
        "POST",
        &format!("{}/v1/backups", m.url),
        Some(&json!({"volume": "src"})),
    );
    assert!(code == 200 || code == 201, "{v}");

    // Restore from the backups page: "Use previous backing image" checked by default, the image's info enabled.
    b.go("#/backups");
    b.wait_text("body", "the backup completed on the page", HEALTHY, |t| {
        t.contains("completed")
    });
    b.click("[data-key^='bi-info-']");
    let info = b.wait_text("dialog", "the backing image info", PAGE, |t| t.contains("bi-up"));
    assert!(info.contains("SHA-512"), "{info}");
    b.click("dialog button[type=button]");
    b.click("[data-key^='restore-']");
    b.wait_text("dialog", "the restore form", PAGE, |t| {
        t.contains("Use previous backing image (bi-up)")
    });
    assert_eq!(
        b.js("return document.getElementById('f-usePrevious').checked", &[]),
        json!(true),
        "Use previous backing image is checked by default"
    );
    assert_eq!(
        b.js(
            "const e = document.querySelector('[data-field=backingImage]'); return e.hidden && e.getClientRects().length === 0",
            &[]
        ),
        json!(true),
        "the image list is hidden (not laid out) while the previous image is used"
    );
    b.fill("#f-name", "restored");
    b.fill("#f-numberOfReplicas", "1");
    b.click("dialog button[type=submit]");
    wait_hash(&b, "#/volumes/restored");
    assert_eq!(volume(&m, "restored")["backingImage"], "bi-up");
    b.wait_text("dl.facts", "the restore completed on the page", HEALTHY, |t| {
        t.contains("completed")
    });
    b.click("[data-key=attach-restored]");
    b.wait_text("dl.facts", "restored healthy", HEALTHY, |t| {
        t.contains("healthy") && t.contains("nbd+unix://")
    });
    reads_image_data(&unix_endpoint(&volume(&m, "restored")));

    // A DR volume from the backup volume's row, activated from its page.
    b.go("#/backups");
    b.click("[data-key^='dr-']");
    b.wait_text("dialog", "the DR form", PAGE, |t| t.contains("Create DR Volume"));
    assert_eq!(
        b.js("return document.getElementById('f-standby').checked", &[]),
        json!(true),
        "a DR volume is a standby one"
    );
    b.fill("#f-name", "dr");
    b.fill("#f-numberOfReplicas", "1");
    b.click("dialog button[type=submit]");
    wait_hash(&b, "#/volumes/dr");
    assert_eq!(restore_of(&m, "dr")["standby"], json!(true));
    b.wait_text("dl.facts", "the standby shown", PAGE, |t| {
        t.contains("follows backup volume")
    });
    b.screenshot(&shots.join("volume-detail-standby-1280.png"));
    b.click("[data-key=activate]");
    b.click("dialog form.confirm button[type=submit]");
    b.wait_text("dl.facts", "dr activated", HEALTHY, |t| t.contains("activated"));
    let r = restore_of(&m, "dr");
    assert_eq!(
        (r["activate"].clone(), r["state"].clone()),
        (json!(true), json!("completed")),
        "{r}"
    );
    assert!(b.find("[data-key=activate]").is_none(), "no Activate once active");

    // A clone of a snapshot of src from src's page: a missing snapshot's message under its field, then the clone.
    b.go("#/volumes/src");
    b.click("[data-key=take-snapshot]");
    let snap = b.wait_text("[data-row] .tree", "the snapshot listed", PAGE, |t| !t.is_empty());
    b.click(&format!("[data-key='clone-{snap}']"));
    b.wait_text("dialog", "the clone form", PAGE, |t| t.contains("Clone snapshot"));
    b.fill("#f-snapshot", "no-such-snapshot");
    b.click("dialog button[type=submit]");
    let e = field_error(&b, "snapshot");
    assert!(e.contains("has no snapshot \"no-such-snapshot\""), "{e}");
    assert!(
        !api_names(&m, "/v1/volumes").contains(&"src-clone".to_owned()),
        "bad input created nothing"
    );
    b.fill("#f-snapshot", &snap);
    b.fill("#f-numberOfReplicas", "1");
    b.screenshot(&shots.join("volume-create-clone-1280.png"));
    b.click("dialog button[type=submit]");
    wait_hash(&b, "#/volumes/src-clone");
    assert_eq!(
        volume(&m, "src-clone")["dataSource"],
        json!(format!("snap://src/{snap}"))
    );
    b.wait_text("dl.facts", "the clone completed on its page", HEALTHY, |t| {
        t.contains("Clone") && t.contains("completed")
    });
    b.click("[data-key=attach-src-clone]");
    b.wait_text("dl.facts", "the clone healthy", HEALTHY, |t| {
        t.contains("healthy") && t.contains("nbd+unix://")
    });
    reads_image_data(&unix_endpoint(&volume(&m, "src-clone")));

    // A rebuild followed live on the volume's page: a replica SIGKILLed, the page (never reloaded) sees the volume
    // degraded, then a new replica in RW and the volume healthy. Every render is recorded by a MutationObserver, so
    // a state between two polls of the test is not missed; the rebuild's progress bars seen are printed.
    let (code, v) = rest(
        "POST",
        &format!("{}/v1/volumes", m.url),
        Some(&json!({"name": "reb", "size": 64 << 20, "numberOfReplicas": 2})),
    );
    assert_eq!(code, 201, "{v}");
    let uri = attach(&m.url, "reb");
    let (ok, out) = testkit::nbd::qemu_io(&uri, &["write -P 0x3c 0 48M", "flush"]);
    assert!(ok, "{out}");
    b.go("#/volumes/reb");
    b.wait_text("dl.facts", "reb healthy", HEALTHY, |t| t.contains("healthy"));
    b.js(
        r"window.__sameDocument = true;
        window.__seen = [];
        const note = () => {
            const robustness = document.querySelectorAll('dl.facts .badge')[1]?.dataset.state;
            const modes = [...document.querySelectorAll('[data-label=Mode]')].map((e) => e.textContent).join(',');
            const bars = [...document.querySelectorAll('[data-label=Rebuild] progress')].map((e) => e.value).join(',');
            const rw = [...document.querySelectorAll('tr[data-row]')]
                .filter((tr) => tr.querySelector('[data-label=Mode]')?.textContent === 'RW').map((tr) => tr.dataset.row);
            window.__seen.push({ robustness, modes, bars, rw });
        };
        new MutationObserver(note).observe(document.getElementById('page'), { childList: true, subtree: true });",
        &[],
    );
    let before = volume(&m, "reb");
    let victim = before["replicas"][0]["pid"].as_i64().expect("a replica pid");
    let old_names: Vec<Value> = before["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].clone())
        .collect();
    sigkill(victim);
    let (ok, out) = testkit::nbd::qemu_io(&uri, &["write -P 0x3d 48M 1M", "flush"]);
    assert!(ok, "IO goes on with one replica: {out}");
    let seen = wait_for("the rebuild followed on the page", HEALTHY, || {
        let seen = b.js("return window.__seen", &[]);
        let rows = seen.as_array()?;
        let degraded = rows.iter().any(|r| r["robustness"] == "degraded");
        let last = rows.last()?;
        let rw = last["rw"].as_array()?;
        let new_rw = rw.len() == 2 && rw.iter().any(|n| !old_names.contains(n));
        (degraded && new_rw && last["robustness"] == "healthy").then_some(seen)
    });
    assert_eq!(
        b.js("return window.__sameDocument === true", &[]),
        json!(true),
        "the page was not reloaded"
    );
    let bars: Vec<&Value> = seen
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["bars"] != "")
        .collect();
    eprintln!(
        "rebuild on the page: {} renders, {} with a progress bar: {bars:?}",
        seen.as_array().unwrap().len(),
        bars.len()
    );
}

/// At 390 px: nothing wider than the screen, the navigation inside it, and a table row laid out as a card (its
/// cells stacked, each under the one before, at the same left edge; an empty cell takes no line).
fn narrow_layout_fits(b: &Browser, page: &str) {
    let v = b.js(
        r"const out = {w: innerWidth, scroll: document.documentElement.scrollWidth, outside: []};
        for (const e of document.querySelectorAll('#nav a, main button, main a, main input, main select')) {
            const r = e.getBoundingClientRect();
            if (r.width > 0 && (r.left < 0 || r.right > innerWidth + 0.5)) out.outside.push(e.outerHTML.slice(0, 80));
        }
        const cells = [...(document.querySelector('table.grid tbody tr')?.children ?? [])].filter((td) => td.getClientRects().length).map((td) => td.getBoundingClientRect());
        out.stacked = cells.length < 2 || cells.every((r, i) => i === 0 || (r.top >= cells[i - 1].bottom - 0.5 && Math.abs(r.left - cells[0].left) < 1));
        return out;",
        &[],
    );
    assert_eq!(v["w"], json!(390), "{page}: viewport {v}");
    assert!(
        v["scroll"].as_i64() <= v["w"].as_i64(),
        "{page}: the page scrolls sideways at 390 px: {v}"
    );
    assert_eq!(
        v["outside"],
        json!([]),
        "{page}: elements outside the screen: {v}"
    );
    assert_eq!(v["stacked"], json!(true), "{page}: table rows are cards: {v}");
}

/// Page weight and speed: the first load of the volumes page listing 200 volumes (every byte the browser fetched,
/// the time from navigation to the rendered table). Prints the figures; run alone (it creates 200 volumes):
/// `cargo nextest run -p manager --test ui --run-ignored ignored-only`.
#[test]
#[ignore = "a measurement: run alone, see CONTRIBUTING.md"]
fn ui_volumes_page_weight_with_200_volumes() {
    if let Some(why) = browser_missing() {
        panic!("{why}");
    }
    let dir = testkit::disk_tempdir("corral-ui-weight-");
    let m = Manager::start(&dir.path().join("n1"), "n1", "embedded", port_range(0));
    for i in 0..200 {
        let (code, v) = rest(
            "POST",
            &format!("{}/v1/volumes", m.url),
            Some(&json!({"name": format!("vol-{i:03}"), "size": 1 << 30, "numberOfReplicas": 1})),
        );
        assert_eq!(code, 201, "{v}");
    }
    // The peer in the same run: the same first load with gzip refused (Accept-Encoding: identity, set through the
    // DevTools protocol), alternated with the normal one, each in a fresh browser (nothing cached).
    for round in 1..=2 {
        for gzip in [false, true] {
            let v = first_load(&m, gzip);
            assert_eq!(v["rows"], json!(200), "{v}");
            let how = if gzip { "gzip" } else { "identity" };
            println!("round {round}, {how}: volumes page with 200 volumes, first load: {v}");
        }
    }
}

/// A fresh browser's first load of the volumes page; with `gzip` false the browser asks for no compression.
fn first_load(m: &Manager, gzip: bool) -> Value {
    let b = Browser::start();
    b.resize(1280, 800);
    if !gzip {
        let cdp = |cmd: &str, params: Value| {
            b.cmd(
                "POST",
                "/goog/cdp/execute",
                Some(&json!({"cmd": cmd, "params": params})),
            );
        };
        cdp("Network.enable", json!({}));
        cdp(
            "Network.setExtraHTTPHeaders",
            json!({"headers": {"Accept-Encoding": "identity"}}),
        );
    }
    b.open(&format!("{}/#/volumes", m.url));
    b.wait_text("table.grid tbody", "200 rows", PAGE, |t| t.contains("vol-199"));
    b.js(
        r"const res = performance.getEntriesByType('resource');
        const nav = performance.getEntriesByType('navigation')[0];
        const bytes = (e) => e.transferSize || e.encodedBodySize || 0;
        return {
            rows: document.querySelectorAll('table.grid tbody tr').length,
            requests: res.length + 1,
            bytes: bytes(nav) + res.reduce((a, e) => a + bytes(e), 0),
            decoded_bytes: (nav.decodedBodySize || 0) + res.reduce((a, e) => a + (e.decodedBodySize || 0), 0),
            ui_bytes: bytes(nav) + res.filter((e) => e.name.includes('/ui/')).reduce((a, e) => a + bytes(e), 0),
            api_bytes: res.filter((e) => e.name.includes('/v1/')).reduce((a, e) => a + bytes(e), 0),
            rendered_ms: Math.round(performance.getEntriesByName('corral-rendered')[0].startTime),
            dom_content_loaded_ms: Math.round(nav.domContentLoadedEventEnd),
        };",
        &[],
    )
}
