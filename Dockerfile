# Minimal images for real clusters (the local test bed runs the same binaries
# as processes and needs no image). One Dockerfile, one binary per image:
#   docker build -t streamfleet/streamfleet:0.1.0 .
#   docker build --build-arg BIN=example-worker -t streamfleet/example-worker:0.1.0 .
FROM rust:1.95-bookworm AS build
ARG BIN=streamfleet
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin "$BIN" && cp "target/release/$BIN" /app

# glibc + CA roots, no shell, runs as uid 65532 (the chart's runAsUser).
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /app /app
USER 65532:65532
ENTRYPOINT ["/app"]
