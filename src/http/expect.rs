//! `Expect: 100-continue`. actix writes `100 Continue` as soon as this
//! service hands a request back, so a `POST /v1/plans` is judged here first,
//! on its head alone, by the route's own admission (`plans::admit`: signed
//! in, allowed, within its login's share, its key and media type, a size
//! within the limit, room for its body). What that reserved goes on with
//! the request, in its extensions, for the route to use. A refusal is
//! answered by the routes themselves, from the same decision (logged,
//! counted, problem+json, `Connection: close`), and goes out instead of the
//! 100: its body is never asked for. Any other request passes at once.

use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::time::Instant;

use actix_http::body::BoxBody;
use actix_http::{HttpMessage, Request, Response};
use actix_service::{Service, ServiceFactory};
use actix_web::dev::{AppConfig, ServiceResponse, Url};

use super::AppState;
use super::observe::Arrived;
use super::plans::{self, Decided};
use crate::deadline::Deadline;

type Local<T> = Pin<Box<dyn Future<Output = T>>>;

/// One [`Judge`] per worker, each with its own instance of the routes.
pub struct ExpectContinue<F> {
    state: AppState,
    routes: F,
    config: AppConfig,
}

impl<F> ExpectContinue<F> {
    pub fn new(state: AppState, routes: F, config: AppConfig) -> Self {
        Self {
            state,
            routes,
            config,
        }
    }
}

impl<F> ServiceFactory<Request> for ExpectContinue<F>
where
    F: ServiceFactory<
            Request,
            Config = AppConfig,
            Response = ServiceResponse<BoxBody>,
            Error = actix_web::Error,
            InitError = (),
        >,
    F::Service: 'static,
    F::Future: 'static,
{
    type Response = Request;
    type Error = Response<BoxBody>;
    type Config = ();
    type Service = Judge<F::Service>;
    type InitError = ();
    type Future = Local<Result<Self::Service, ()>>;

    fn new_service(&self, (): ()) -> Self::Future {
        let routes = self.routes.new_service(self.config.clone());
        let state = Rc::new(self.state.clone());
        Box::pin(async move {
            Ok(Judge {
                state,
                routes: Rc::new(routes.await?),
            })
        })
    }
}

/// Judges one worker's requests that say `Expect: 100-continue`.
pub struct Judge<S> {
    state: Rc<AppState>,
    /// Answers the refused, as if their bodies had been sent.
    routes: Rc<S>,
}

impl<S> Service<Request> for Judge<S>
where
    S: Service<Request, Response = ServiceResponse<BoxBody>, Error = actix_web::Error> + 'static,
{
    type Response = Request;
    type Error = Response<BoxBody>;
    type Future = Local<Result<Request, Response<BoxBody>>>;

    actix_service::always_ready!();

    fn call(&self, req: Request) -> Self::Future {
        // The path as the router matches it (percent-decoded).
        let path = Url::new(req.uri().clone());
        if !plans::is_submission(req.method(), path.path()) {
            return Box::pin(std::future::ready(Ok(req)));
        }
        let (state, routes) = (Rc::clone(&self.state), Rc::clone(&self.routes));
        Box::pin(async move {
            let arrived = Instant::now();
            let deadline = Deadline::after(state.http.request_timeout);
            let decided = plans::admit(&req, &state, deadline).await;
            let admitted = decided.is_ok();
            {
                let mut extensions = req.extensions_mut();
                extensions.insert(Arrived(arrived));
                extensions.insert(deadline);
                extensions.insert(Decided(decided));
            }
            if admitted {
                return Ok(req);
            }
            // The answer leaves the body unread: it closes the connection.
            match routes.call(req).await {
                Ok(answer) => Err(answer.into()),
                Err(error) => Err(error.into()),
            }
        })
    }
}
