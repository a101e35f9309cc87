//! The service's endpoints as a client calls them: one method per door, each
//! building its request in one place, so a change to a path or to the way a
//! caller proves who they are lands once.
//!
//! Every door returns the request unsent. The API tests send it and expect an
//! answer; the fault suite and the benchmarks keep the error, where a lost
//! connection is a finding and not a failure of the harness.

use flashsale::auth::Auth;
use reqwest::{Method, RequestBuilder};
use serde_json::Value;

/// Who a request comes from.
#[derive(Debug, Clone, Copy)]
pub enum Caller<'a> {
    /// No `Authorization` header at all.
    Anonymous,
    /// A user, with a token the service accepts.
    User(&'a str),
    /// This bearer token, as it is (forged, expired or malformed ones too).
    Token(&'a str),
    /// This whole `Authorization` header (another scheme than `Bearer`).
    Header(&'a str),
    /// The operators' shared admin token.
    Admin,
}

/// The doors of one instance of the service.
#[derive(Clone)]
pub struct Api {
    pub client: reqwest::Client,
    /// `http://host:port`, without a trailing slash.
    pub base: String,
    admin_token: String,
    /// Signs user tokens; without it a user's requests carry an empty token.
    users: Option<Auth>,
}

impl Api {
    pub fn new(client: reqwest::Client, base: impl Into<String>, admin_token: &str) -> Api {
        Api {
            client,
            base: base.into(),
            admin_token: admin_token.to_owned(),
            users: None,
        }
    }

    /// The same doors, with user tokens signed as the service expects them.
    pub fn with_users(mut self, auth: Auth) -> Api {
        self.users = Some(auth);
        self
    }

    /// The same doors on another instance (or another listener) of the service.
    pub fn on(&self, base: impl Into<String>) -> Api {
        Api {
            base: base.into(),
            ..self.clone()
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// A token for `user`, valid for an hour (empty when no signer was given or
    /// signing failed: the service then answers `401`, which the test sees).
    pub fn token(&self, user: &str) -> String {
        self.users
            .as_ref()
            .and_then(|auth| auth.issue(user, 3600).ok())
            .unwrap_or_default()
    }

    /// Any request, from `caller`: the one place a request is built.
    pub fn request(&self, method: Method, path: &str, caller: Caller<'_>) -> RequestBuilder {
        let request = self.client.request(method, self.url(path));
        match caller {
            Caller::Anonymous => request,
            Caller::User(user) => request.bearer_auth(self.token(user)),
            Caller::Token(token) => request.bearer_auth(token),
            Caller::Header(value) => request.header(reqwest::header::AUTHORIZATION, value),
            Caller::Admin => request.bearer_auth(&self.admin_token),
        }
    }

    // Users.

    /// `GET /flash/{sku}`: the sale's state and units left.
    pub fn sale(&self, sku: &str) -> RequestBuilder {
        self.request(Method::GET, &format!("/flash/{sku}"), Caller::Anonymous)
    }

    /// `POST /flash/{sku}/reserve`, without a body (add one with `.json`).
    pub fn reserve(&self, sku: &str, caller: Caller<'_>) -> RequestBuilder {
        self.request(Method::POST, &format!("/flash/{sku}/reserve"), caller)
    }

    /// `GET /flash/{sku}/reservation`: the caller's reservation and its order.
    pub fn reservation(&self, sku: &str, caller: Caller<'_>) -> RequestBuilder {
        self.request(Method::GET, &format!("/flash/{sku}/reservation"), caller)
    }

    /// `POST /flash/{sku}/queue`: joins the waiting room.
    pub fn join_queue(&self, sku: &str, caller: Caller<'_>) -> RequestBuilder {
        self.request(Method::POST, &format!("/flash/{sku}/queue"), caller)
    }

    /// `GET /flash/{sku}/queue`: the caller's place in the waiting room.
    pub fn queue_place(&self, sku: &str, caller: Caller<'_>) -> RequestBuilder {
        self.request(Method::GET, &format!("/flash/{sku}/queue"), caller)
    }

    /// `POST /orders/{order_id}/pay`.
    pub fn pay(&self, order_id: &str, caller: Caller<'_>) -> RequestBuilder {
        self.request(Method::POST, &format!("/orders/{order_id}/pay"), caller)
    }

    // Operators.

    /// `POST /admin/activities`.
    pub fn create_activity(&self, body: &Value) -> RequestBuilder {
        self.request(Method::POST, "/admin/activities", Caller::Admin)
            .json(body)
    }

    /// `GET /admin/activities`: every activity with its live figures.
    pub fn activities(&self) -> RequestBuilder {
        self.request(Method::GET, "/admin/activities", Caller::Admin)
    }

    /// `GET /admin/activities/{id}`: the activity with its live figures.
    pub fn activity(&self, id: &str) -> RequestBuilder {
        self.request(
            Method::GET,
            &format!("/admin/activities/{id}"),
            Caller::Admin,
        )
    }

    /// `POST /admin/activities/{id}/{step}`, for `preload`, `pause`, `resume`
    /// and `reconcile`, the operators' steps that take no body.
    pub fn admin_step(&self, id: &str, step: &str) -> RequestBuilder {
        self.admin_step_as(id, step, Caller::Admin)
    }

    /// `admin_step` from another caller (a named operator's token, a JWT).
    pub fn admin_step_as(&self, id: &str, step: &str, caller: Caller<'_>) -> RequestBuilder {
        self.request(
            Method::POST,
            &format!("/admin/activities/{id}/{step}"),
            caller,
        )
    }

    pub fn preload(&self, id: &str) -> RequestBuilder {
        self.admin_step(id, "preload")
    }

    pub fn pause(&self, id: &str) -> RequestBuilder {
        self.admin_step(id, "pause")
    }

    pub fn resume(&self, id: &str) -> RequestBuilder {
        self.admin_step(id, "resume")
    }

    pub fn reconcile(&self, id: &str) -> RequestBuilder {
        self.admin_step(id, "reconcile")
    }

    /// `POST /admin/activities/{id}/stock` with this body (`{"add": N}`).
    pub fn top_up(&self, id: &str, body: &Value) -> RequestBuilder {
        self.request(
            Method::POST,
            &format!("/admin/activities/{id}/stock"),
            Caller::Admin,
        )
        .json(body)
    }

    /// `GET /admin/audit` with this query string (`activity_id=…&limit=…`,
    /// or empty), from `caller`.
    pub fn audit(&self, query: &str, caller: Caller<'_>) -> RequestBuilder {
        let path = if query.is_empty() {
            "/admin/audit".to_owned()
        } else {
            format!("/admin/audit?{query}")
        };
        self.request(Method::GET, &path, caller)
    }

    // Operations and pages.

    pub fn healthz(&self) -> RequestBuilder {
        self.request(Method::GET, "/healthz", Caller::Anonymous)
    }

    pub fn readyz(&self) -> RequestBuilder {
        self.request(Method::GET, "/readyz", Caller::Anonymous)
    }

    pub fn metrics(&self) -> RequestBuilder {
        self.request(Method::GET, "/metrics", Caller::Anonymous)
    }

    pub fn openapi(&self) -> RequestBuilder {
        self.request(Method::GET, "/openapi.json", Caller::Anonymous)
    }

    pub fn admin_ui(&self) -> RequestBuilder {
        self.request(Method::GET, "/admin/ui", Caller::Anonymous)
    }
}
