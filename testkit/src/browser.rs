//! A real headless browser for page tests: Debian's chromium driven by its
//! chromedriver over the W3C WebDriver protocol (plain JSON over HTTP).
//! `scripts/tools.sh` installs both.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::process::{free_port, wait_for_port, Proc};

const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// A chromedriver with one headless browser session; dropping it ends both.
pub struct Browser {
    http: reqwest::Client,
    session: String,
    base: String,
    _driver: Proc,
}

impl Browser {
    /// Starts chromedriver (its log in `dir`) and a headless chromium session.
    pub async fn start(dir: &Path) -> Result<Self, String> {
        let port = free_port();
        let mut cmd = Command::new("chromedriver");
        cmd.arg(format!("--port={port}"));
        let driver = Proc::spawn("chromedriver", cmd, dir.join("chromedriver.log"));
        tokio::task::block_in_place(|| {
            wait_for_port(port, Duration::from_secs(30), "chromedriver")
        });
        let base = format!("http://127.0.0.1:{port}");
        let http = reqwest::Client::new();
        let profile = dir.join("chromium-profile");
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": "/usr/bin/chromium",
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                         "--disable-dev-shm-usage", "--window-size=1280,900",
                         format!("--user-data-dir={}", profile.display())]
            }
        }}});
        let resp: Value = http
            .post(format!("{base}/session"))
            .json(&caps)
            .send()
            .await
            .map_err(|e| format!("chromedriver: {e}"))?
            .json()
            .await
            .map_err(|e| format!("chromedriver: {e}"))?;
        let session = resp["value"]["sessionId"]
            .as_str()
            .ok_or_else(|| format!("no browser session: {resp}"))?
            .to_owned();
        Ok(Browser {
            http,
            session,
            base,
            _driver: driver,
        })
    }

    /// One browser per name, each in a folder of its own under `dir` (its
    /// profile, so no storage is shared, and its driver's log): separate
    /// people, as a page test with several users needs.
    pub async fn start_each(dir: &Path, names: &[&str]) -> Result<Vec<Self>, String> {
        let mut browsers = Vec::with_capacity(names.len());
        for name in names {
            let own = dir.join(name);
            std::fs::create_dir_all(&own).map_err(|e| format!("{}: {e}", own.display()))?;
            browsers.push(Browser::start(&own).await?);
        }
        Ok(browsers)
    }

    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Value,
    ) -> Result<Value, String> {
        let url = format!("{}/session/{}{path}", self.base, self.session);
        let mut req = self.http.request(method, url);
        if !body.is_null() {
            req = req.json(&body);
        }
        let resp: Value = req
            .send()
            .await
            .map_err(|e| format!("webdriver {path}: {e}"))?
            .json()
            .await
            .map_err(|e| format!("webdriver {path}: {e}"))?;
        if resp["value"]["error"].is_string() {
            return Err(format!("webdriver {path}: {}", resp["value"]));
        }
        Ok(resp["value"].clone())
    }

    pub async fn goto(&self, url: &str) -> Result<(), String> {
        self.call(reqwest::Method::POST, "/url", json!({ "url": url }))
            .await
            .map(|_| ())
    }

    /// The address the window shows now.
    pub async fn url(&self) -> Result<String, String> {
        let v = self.call(reqwest::Method::GET, "/url", Value::Null).await?;
        v.as_str()
            .map(str::to_owned)
            .ok_or_else(|| format!("no address: {v}"))
    }

    async fn find(&self, css: &str) -> Result<String, String> {
        let v = self
            .call(
                reqwest::Method::POST,
                "/element",
                json!({"using": "css selector", "value": css}),
            )
            .await?;
        v[ELEMENT]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| format!("no element {css}: {v}"))
    }

    pub async fn type_into(&self, css: &str, text: &str) -> Result<(), String> {
        let el = self.find(css).await?;
        self.call(
            reqwest::Method::POST,
            &format!("/element/{el}/value"),
            json!({ "text": text }),
        )
        .await
        .map(|_| ())
    }

    pub async fn click(&self, css: &str) -> Result<(), String> {
        let el = self.find(css).await?;
        self.call(
            reqwest::Method::POST,
            &format!("/element/{el}/click"),
            json!({}),
        )
        .await
        .map(|_| ())
    }

    pub async fn text(&self, css: &str) -> Result<String, String> {
        let el = self.find(css).await?;
        let v = self
            .call(
                reqwest::Method::GET,
                &format!("/element/{el}/text"),
                Value::Null,
            )
            .await?;
        Ok(v.as_str().unwrap_or_default().to_owned())
    }

    /// Whether the element (a button, an input) is enabled.
    pub async fn enabled(&self, css: &str) -> Result<bool, String> {
        let el = self.find(css).await?;
        let v = self
            .call(
                reqwest::Method::GET,
                &format!("/element/{el}/enabled"),
                Value::Null,
            )
            .await?;
        v.as_bool()
            .ok_or_else(|| format!("{css}: not a yes or no: {v}"))
    }

    /// Waits until the element is enabled, then clicks it: a click on a
    /// disabled button is silently lost.
    pub async fn click_when_enabled(&self, css: &str, within: Duration) -> Result<(), String> {
        let deadline = Instant::now() + within;
        while !self.enabled(css).await.unwrap_or(false) {
            if Instant::now() > deadline {
                return Err(format!("{css} still disabled after {within:?}"));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        self.click(css).await
    }

    /// Accepts the `confirm()` dialog the page opened.
    pub async fn accept_dialog(&self) -> Result<(), String> {
        self.call(reqwest::Method::POST, "/alert/accept", json!({}))
            .await
            .map(|_| ())
    }

    /// Waits until the element's text satisfies `ok`; returns it.
    pub async fn wait_text(
        &self,
        css: &str,
        within: Duration,
        ok: impl Fn(&str) -> bool,
    ) -> Result<String, String> {
        let deadline = Instant::now() + within;
        loop {
            let t = self.text(css).await.unwrap_or_default();
            if ok(&t) {
                return Ok(t);
            }
            if Instant::now() > deadline {
                return Err(format!("{css} still reads {t:?}"));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// A PNG of the window.
    pub async fn screenshot(&self) -> Result<Vec<u8>, String> {
        let v = self
            .call(reqwest::Method::GET, "/screenshot", Value::Null)
            .await?;
        let b64 = v.as_str().ok_or("no screenshot")?;
        decode_base64(b64)
    }

    /// A PNG of the window, written to `path` (its folder made if missing).
    pub async fn save_screenshot(&self, path: &Path) -> Result<(), String> {
        let png = self.screenshot().await?;
        if !png.starts_with(b"\x89PNG") {
            return Err("the screenshot is not a PNG".into());
        }
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
        }
        std::fs::write(path, png).map_err(|e| format!("{}: {e}", path.display()))
    }
}

impl Drop for Browser {
    /// Ends the session, so the browser does not outlive the driver (which
    /// stops after this, with `_driver`): a blocking request, as `Drop` cannot
    /// wait for a future.
    fn drop(&mut self) {
        use std::io::{Read, Write};
        let Some(addr) = self.base.strip_prefix("http://") else {
            return;
        };
        let Ok(mut stream) = std::net::TcpStream::connect(addr) else {
            return;
        };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
        let request = format!(
            "DELETE /session/{} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            self.session
        );
        if stream.write_all(request.as_bytes()).is_ok() {
            let _ = stream.read_to_end(&mut Vec::new());
        }
    }
}

/// Standard base64, as WebDriver sends screenshots.
fn decode_base64(s: &str) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(s.len() * 3 / 4);
    let mut buf = 0u32;
    let mut bits = 0;
    for c in s.bytes() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            b'=' | b'\n' | b'\r' => continue,
            _ => return Err("screenshot is not base64".into()),
        };
        buf = (buf << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((buf >> bits) as u8);
        }
    }
    Ok(out)
}
