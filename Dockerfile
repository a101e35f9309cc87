# syntax=docker/dockerfile:1

# ---- build ----------------------------------------------------------------
# rust:bookworm (buildpack-deps) already has gcc, make, perl and zlib headers,
# which is all rdkafka's default build needs: it compiles the bundled
# librdkafka with librdkafka's own configure script (no cmake, no OpenSSL/SASL).
FROM rust:1-bookworm AS builder
WORKDIR /src

# Dependency layer: build all crates once against a dummy lib/bin, so editing
# src/ does not recompile the ~240 dependencies. (Should Cargo.toml ever name
# [[bench]]/[[test]]/[[example]] targets or a build.rs explicitly, stub or
# copy those files here too: cargo checks target paths when it reads the manifest.)
COPY Cargo.toml Cargo.lock ./
# The benchmark and test-kit crates are workspace members: cargo reads their
# manifests and target paths, though `cargo build` at the root never builds them.
COPY bench ./bench
COPY testkit ./testkit
RUN mkdir -p src tests/faults \
 && echo 'fn main() {}' > src/main.rs \
 && echo 'fn main() {}' > tests/faults/main.rs \
 && touch src/lib.rs \
 && cargo build --release --locked \
 && rm -rf src

# The real sources. The Lua scripts (src/stock/*.lua) are compiled in with
# include_str!, and the migrations with sqlx::migrate!, so both must be present
# at build time; config/ is only needed at run time but is tiny.
# If compile-time checked sqlx::query! macros are adopted, run
# `cargo sqlx prepare` and add `COPY .sqlx ./.sqlx` here (SQLX_OFFLINE is set).
COPY src ./src
COPY migrations ./migrations
COPY config ./config
ENV SQLX_OFFLINE=true
# COPY keeps the files' original mtimes, which can be older than the dummy
# build above; drop our own crate's fingerprints so cargo really rebuilds it.
RUN rm -rf target/release/.fingerprint/flashsale-* \
           target/release/deps/flashsale-* \
           target/release/deps/libflashsale-* \
 && cargo build --release --locked --bin flashsale

# ---- runtime --------------------------------------------------------------
# Same Debian release as the builder, so the glibc the binary links against
# matches. librdkafka is linked statically; zlib1g is already in the slim image.
FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/*
RUN useradd --system --user-group --uid 10001 --home-dir /app --no-create-home flashsale

COPY --from=builder /src/target/release/flashsale /usr/local/bin/flashsale
# Defaults; override any key with FLASHSALE__SECTION__KEY environment variables.
COPY config/ /app/config/
# An image is a deployment: config/production.toml applies, and `serve` refuses
# the published development secrets. Pass FLASHSALE__AUTH__ADMIN_TOKEN and
# FLASHSALE__AUTH__USER_TOKEN_SECRET (at least 16 characters each). It also
# refuses orders paid on their owners' word (payments.provider = "none", the
# only provider yet) unless FLASHSALE__PAYMENTS__ALLOW_UNVERIFIED=true says
# that is meant.
ENV FLASHSALE_ENV=production
WORKDIR /app
USER flashsale

EXPOSE 8080
# Migrations are embedded in the binary: `flashsale migrate` needs no files.
ENTRYPOINT ["flashsale"]
CMD ["serve"]
