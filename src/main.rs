//! The `flashsale` binary: a thin shell over the library.

use anyhow::Context;
use clap::{Parser, Subcommand};

use flashsale::auth::Auth;
use flashsale::config::{self, Settings};
use flashsale::startup::{self, Application};
use flashsale::telemetry;

/// mimalloc: a request allocates and frees dozens of small objects across two
/// worker threads, where glibc's malloc showed up as an eighth of the flood's CPU.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "flashsale",
    version,
    about = "Flash-sale stock reservation service"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the HTTP API (and the background workers enabled in the configuration).
    Serve,
    /// Run the order consumer alone (no HTTP), to scale consumers apart from the API.
    Consume,
    /// One reconciler pass (Redis against MySQL), with a readable report.
    Reconcile {
        /// Only this activity (default: every current one).
        #[arg(long)]
        activity: Option<String>,
        /// Print the reports as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Create the database if needed and apply the migrations.
    Migrate,
    /// Print the OpenAPI 3.1 document of the HTTP API (as `GET /openapi.json`).
    Openapi,
    /// Print a signed user token (HS256, `auth.user_token_secret`), for trying
    /// the API by hand.
    Token {
        /// The user id (the token's `sub`).
        #[arg(long)]
        user: String,
        /// Validity in seconds.
        #[arg(long, default_value_t = 3600, value_parser = clap::value_parser!(i64).range(1..=MAX_TTL_SECS))]
        ttl_secs: i64,
    },
}

/// `flashsale token --ttl-secs` at most: ten years.
const MAX_TTL_SECS: i64 = 10 * 365 * 24 * 3600;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let settings = Settings::load()?;
    let telemetry = telemetry::init_tracing(&settings.log, &settings.telemetry)?;
    let result = run(cli.command, settings).await;
    // The spans of the last moments are sent before the process exits.
    telemetry.shutdown().await;
    result
}

async fn run(command: Command, settings: Settings) -> anyhow::Result<()> {
    match command {
        Command::Serve => {
            settings.check_published_secrets(&config::environment())?;
            settings.check_payments(&config::environment())?;
            settings.check_identity_provider()?;
            let app = Application::build(settings).await?;
            let drain = app.drain_token();
            tokio::spawn(async move {
                startup::shutdown_signal().await;
                drain.cancel();
            });
            app.run_until_stopped().await
        }
        Command::Consume => {
            let token = tokio_util::sync::CancellationToken::new();
            let stop = token.clone();
            tokio::spawn(async move {
                startup::shutdown_signal().await;
                stop.cancel();
            });
            startup::run_consumer(settings, token).await
        }
        Command::Reconcile { activity, json } => {
            let reports = startup::reconcile_once(&settings, activity.as_deref()).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&reports)?);
            } else if reports.is_empty() {
                println!("no current activity");
            } else {
                for r in &reports {
                    println!("{}", r.summary());
                }
            }
            Ok(())
        }
        Command::Migrate => {
            startup::migrate(&settings.mysql).await?;
            println!("migrations applied");
            Ok(())
        }
        Command::Openapi => {
            use utoipa::OpenApi;
            println!(
                "{}",
                flashsale::http::ApiDoc::openapi()
                    .to_pretty_json()
                    .context("cannot write the OpenAPI document")?
            );
            Ok(())
        }
        Command::Token { user, ttl_secs } => {
            if !settings.auth.hs256 {
                anyhow::bail!("auth.hs256 is false: the service refuses HS256 user tokens; get one from the identity provider");
            }
            let auth = Auth::new(
                settings.auth.admin_token.clone(),
                &settings.auth.user_token_secret,
            )?;
            let token = auth
                .issue(&user, ttl_secs)
                .context("cannot issue the token")?;
            println!("{token}");
            Ok(())
        }
    }
}
