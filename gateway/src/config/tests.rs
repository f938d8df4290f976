use clap::Parser;

use super::*;

#[derive(Debug, Parser)]
#[command(args_override_self = true)]
struct Cli {
    #[command(flatten)]
    args: Args,
}

const REQUIRED: &[&str] = &[
    "gateway",
    "--upstream",
    "http://127.0.0.1:3000",
    "--namespace",
    "orders",
];

fn parse(extra: &[&str]) -> Result<Args, clap::Error> {
    Cli::try_parse_from(REQUIRED.iter().chain(extra)).map(|cli| cli.args)
}

fn settings(extra: &[&str]) -> Result<Settings, SettingError> {
    parse(extra).expect("flags parse").settings()
}

/// The flag a refused setting names.
/// Asserts that `--flag value` is refused, naming `flag`, for each of `values`.
fn assert_each_refused(flag: &str, values: &[&str]) {
    let option = format!("--{flag}");
    for value in values {
        assert_eq!(refused_flag(&[&option, value]), flag, "{value:?}");
    }
}

fn refused_flag(extra: &[&str]) -> &'static str {
    match settings(extra) {
        Ok(settings) => panic!("{extra:?} was accepted: {settings:?}"),
        Err(error) => {
            assert!(error.to_string().contains(error.flag), "{error}");
            error.flag
        }
    }
}

#[test]
fn the_defaults_are_the_issues() {
    let settings = settings(&[]).expect("defaults are valid");
    assert_eq!(settings.listen.to_string(), "127.0.0.1:8080");
    assert_eq!(settings.coordinator, "http://127.0.0.1:50051");
    assert_eq!(settings.methods, [Method::POST, Method::PATCH]);
    assert_eq!(settings.header.as_str(), "idempotency-key");
    assert!(settings.require_key.is_empty());
    assert!(settings.identity_header.is_none());
    assert!(!settings.fail_open);
    assert_eq!(settings.wait, Duration::from_secs(5));
    assert_eq!(settings.lease, Duration::from_secs(30));
    assert_eq!(settings.retention, Duration::from_secs(24 * 3600));
    assert_eq!(settings.max_request_bytes, MIB);
    assert_eq!(settings.max_stored_response_bytes, MIB);
    assert_eq!(settings.upstream.authority.as_str(), "127.0.0.1:3000");
    assert_eq!(settings.upstream.path_prefix, "");
}

#[test]
fn the_upstream_and_namespace_are_required() {
    assert!(Cli::try_parse_from(["gateway", "--namespace", "orders"]).is_err());
    assert!(Cli::try_parse_from(["gateway", "--upstream", "http://a:1"]).is_err());
}

#[test]
fn every_duration_is_bounded() {
    for (flag, below, lowest, highest, above) in [
        ("wait", None, "0s", "60s", "61s"),
        ("lease", Some("99ms"), "100ms", "24h", "25h"),
        ("retention", Some("999ms"), "1s", "30d", "31d"),
        ("upstream-timeout", Some("99ms"), "100ms", "1h", "61m"),
        ("coordinator-timeout", Some("99ms"), "100ms", "60s", "61s"),
        ("coordinator-retry", None, "0s", "60s", "61s"),
        ("shutdown-grace", None, "0s", "10m", "601s"),
    ] {
        let option = format!("--{flag}");
        for valid in [lowest, highest] {
            assert!(settings(&[&option, valid]).is_ok(), "{flag} {valid}");
        }
        assert_eq!(refused_flag(&[&option, above]), flag);
        if let Some(below) = below {
            assert_eq!(refused_flag(&[&option, below]), flag);
        }
        assert!(
            parse(&[&option, "soon"]).is_err(),
            "{flag} parses durations"
        );
    }
}

#[test]
fn every_size_is_bounded() {
    for flag in ["max-request-bytes", "max-stored-response-bytes"] {
        let option = format!("--{flag}");
        assert!(settings(&[&option, "1024"]).is_ok());
        assert!(settings(&[&option, "67108864"]).is_ok());
        assert_eq!(refused_flag(&[&option, "1023"]), flag);
        assert_eq!(refused_flag(&[&option, "67108865"]), flag);
    }
    assert!(settings(&["--max-key-length", "1"]).is_ok());
    assert!(settings(&["--max-key-length", "190"]).is_ok());
    assert_each_refused("max-key-length", &["0", "191"]);
}

#[test]
fn methods_are_listed_in_capitals() {
    let put = settings(&["--methods", "PUT,POST,DELETE"]).expect("valid");
    assert_eq!(put.methods, [Method::PUT, Method::POST, Method::DELETE]);
    let seventeen = vec!["POST"; 17].join(",");
    assert_each_refused("methods", &["post", "PO ST", "", &seventeen]);
}

#[test]
fn header_names_must_be_valid() {
    let custom = settings(&[
        "--header",
        "X-Request-Key",
        "--identity-header",
        "X-Api-Key",
    ])
    .expect("valid");
    assert_eq!(custom.header.as_str(), "x-request-key");
    assert_eq!(
        custom.identity_header.map(|h| h.as_str().to_owned()),
        Some("x-api-key".into())
    );
    assert_each_refused("header", &["bad header", "", &"x".repeat(65)]);
    assert_eq!(
        refused_flag(&["--identity-header", "caller:id"]),
        "identity-header"
    );
}

#[test]
fn required_key_prefixes_are_paths() {
    let required = settings(&["--require-key", "/orders,/payments/"]).expect("valid");
    assert_eq!(required.require_key, ["/orders", "/payments/"]);
    let many = vec!["/a"; 65].join(",");
    assert_each_refused("require-key", &["orders", "/a?b=1", &many]);
}

#[test]
fn endpoints_and_the_namespace_are_checked() {
    let prefixed = settings(&["--upstream", "http://api.internal:8000/v1/"]).expect("valid");
    assert_eq!(prefixed.upstream.path_prefix, "/v1");
    assert_each_refused(
        "upstream",
        &["https://api:443", "api:3000", "http://a:1/?x=1"],
    );
    assert_eq!(
        refused_flag(&["--coordinator", "grpc://a:1"]),
        "coordinator"
    );
    assert_eq!(refused_flag(&["--coordinator", "not a url"]), "coordinator");
    assert_eq!(
        refused_flag(&["--coordinator", "https://c.internal:50051"]),
        "coordinator-ca",
        "TLS needs the CA"
    );
    assert_each_refused("namespace", &["has space", "", &"n".repeat(65)]);
}

#[test]
fn the_token_and_ca_files_are_read_at_start() {
    let dir = std::env::temp_dir().join(format!("gateway-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let token = dir.join("token");
    std::fs::write(&token, "  secret-token\n").expect("write");
    let path = token.to_str().expect("utf-8 path");
    let read = settings(&["--token-file", path]).expect("valid");
    assert_eq!(read.token.as_deref(), Some("secret-token"));
    std::fs::write(&token, "two words\n").expect("write");
    assert_eq!(refused_flag(&["--token-file", path]), "token-file");
    std::fs::write(&token, "\n").expect("write");
    assert_eq!(refused_flag(&["--token-file", path]), "token-file");
    let missing = dir.join("missing");
    let missing = missing.to_str().expect("utf-8 path");
    assert_eq!(refused_flag(&["--token-file", missing]), "token-file");
    assert_eq!(
        refused_flag(&["--coordinator-ca", missing]),
        "coordinator-ca"
    );
    std::fs::remove_dir_all(&dir).expect("clean up");
}

#[test]
fn the_log_format_is_text_or_json() {
    assert!(parse(&["--log-format", "json"]).is_ok());
    assert!(parse(&["--log-format", "xml"]).is_err());
}
