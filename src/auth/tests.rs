//! Tokens files, scopes, authentication and the rate limit.

use std::num::NonZeroU32;

use super::AdminRight;
use super::rate::RateLimiter;
use super::tokens::MAX_TOKENS_FILE_BYTES;
use super::*;

fn set(text: &str) -> TokenSet {
    TokenSet::parse(text).expect("valid tokens file")
}

#[test]
fn generated_tokens_authenticate_through_their_line() {
    let (token, line) =
        new_token("payments", "payments-*,billing", AdminRight::None).expect("a token");
    assert!(token.starts_with(TOKEN_PREFIX));
    assert!(
        !line.contains(&token),
        "the line never holds the token itself"
    );
    let tokens = set(&format!("# comment\n\n{line}\n"));
    let caller = tokens.authenticate(&token).expect("known");
    assert_eq!(caller.name, "payments");
    assert!(caller.may_use("payments-eu"));
    assert!(caller.may_use("billing"));
    assert!(!caller.may_use("billing-2"));
    assert!(!caller.may_use("shipping"));
    assert!(tokens.authenticate("idc_wrong").is_none());
}

#[test]
fn a_star_allows_every_scope() {
    let (token, line) = new_token("admin", "*", AdminRight::None).expect("a token");
    assert!(
        set(&line)
            .authenticate(&token)
            .expect("known")
            .may_use("anything")
    );
}

#[test]
fn malformed_lines_are_refused_with_their_number() {
    for (text, line) in [
        ("a sha256:00 b", 1),
        ("\nname md5:abc scope", 2),
        (
            "only-two sha256:0000000000000000000000000000000000000000000000000000000000000000",
            1,
        ),
        (
            "bad/name sha256:0000000000000000000000000000000000000000000000000000000000000000 s",
            1,
        ),
        (
            "n sha256:0000000000000000000000000000000000000000000000000000000000000000 has*star*",
            1,
        ),
        (
            "n sha256:0000000000000000000000000000000000000000000000000000000000000000 sp ace",
            1,
        ),
    ] {
        match TokenSet::parse(text) {
            Err(TokensFileError::Invalid { line: got, .. }) => assert_eq!(got, line, "{text}"),
            other => panic!("{text:?} gave {other:?}"),
        }
    }
    let twice = "a sha256:0000000000000000000000000000000000000000000000000000000000000000 s\n\
                 a sha256:1111111111111111111111111111111111111111111111111111111111111111 s";
    assert!(TokenSet::parse(twice).is_err(), "a name twice");
}

/// A tokens file of one new token, in a folder of its own, and an authenticator that loaded it.
struct TokensOnDisk {
    token: String,
    line: String,
    dir: std::path::PathBuf,
    path: std::path::PathBuf,
    authenticator: Authenticator,
}

fn tokens_on_disk(folder: &str) -> TokensOnDisk {
    let (token, line) = new_token("payments", "*", AdminRight::None).expect("a token");
    let dir = std::env::temp_dir().join(format!("{folder}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a folder");
    let path = dir.join("tokens");
    std::fs::write(&path, &line).expect("write");
    let authenticator = Authenticator::load(&path, None).expect("loads");
    TokensOnDisk {
        token,
        line,
        dir,
        path,
        authenticator,
    }
}

fn admits(authenticator: &Authenticator, token: &str) -> bool {
    authenticator
        .authenticate(Some(&format!("Bearer {token}")))
        .is_ok()
}

/// Reloads the tokens file, which must be refused as `expected` tells, and asserts that the
/// tokens in force (`token` among them) stayed.
fn assert_reload_refused(
    authenticator: &Authenticator,
    token: &str,
    expected: impl Fn(&TokensFileError) -> bool,
) {
    let refused = authenticator.reload().expect_err("the reload is refused");
    assert!(expected(&refused), "{refused:?}");
    assert!(admits(authenticator, token), "the tokens in force stayed");
}

#[test]
fn the_bearer_scheme_is_case_insensitive() {
    let TokensOnDisk {
        token,
        dir,
        path,
        authenticator,
        ..
    } = tokens_on_disk("auth-test");
    for header in [
        format!("Bearer {token}"),
        format!("bearer  {token} "),
        format!("BEARER {token}"),
    ] {
        assert!(
            authenticator.authenticate(Some(&header)).is_ok(),
            "{header}"
        );
    }
    for header in [format!("Basic {token}"), token.clone(), "Bearer".into()] {
        assert!(
            authenticator.authenticate(Some(&header)).is_err(),
            "{header}"
        );
    }
    // An emptied file is refused, and the tokens in force stay.
    std::fs::write(&path, "# nothing here\n").expect("write");
    assert_reload_refused(&authenticator, &token, |refused| {
        matches!(refused, TokensFileError::Empty { .. })
    });
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn only_a_regular_file_of_at_most_16_mib_is_read_as_a_tokens_file() {
    let TokensOnDisk {
        token,
        line,
        dir,
        path,
        authenticator,
    } = tokens_on_disk("auth-kinds");

    // A folder in its place is refused by kind, without reading.
    std::fs::remove_file(&path).expect("remove");
    std::fs::create_dir(&path).expect("a folder in its place");
    assert_reload_refused(&authenticator, &token, |refused| {
        matches!(
            refused,
            TokensFileError::NotAFile {
                kind: "a folder",
                ..
            }
        )
    });
    std::fs::remove_dir(&path).expect("remove the folder");

    // A symlink to a regular file is followed.
    let target = dir.join("tokens.real");
    std::fs::write(&target, &line).expect("write");
    std::os::unix::fs::symlink(&target, &path).expect("symlink");
    assert_eq!(authenticator.reload().expect("through the symlink"), 1);
    std::fs::remove_file(&path).expect("remove the symlink");

    // The size bound: 16 MiB is read, one byte more is refused.
    let file = std::fs::File::create(&path).expect("create");
    std::io::Write::write_all(&mut &file, line.as_bytes()).expect("write");
    file.set_len(MAX_TOKENS_FILE_BYTES).expect("grow");
    // The rest of the file is NUL bytes, which no line parses: refused for its content.
    assert_reload_refused(&authenticator, &token, |refused| {
        matches!(refused, TokensFileError::Invalid { .. })
    });
    file.set_len(MAX_TOKENS_FILE_BYTES + 1).expect("grow");
    assert_reload_refused(&authenticator, &token, |refused| {
        matches!(refused, TokensFileError::TooLarge { .. })
    });
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn the_rate_limit_admits_bursts_of_its_rate_then_refuses() {
    let limiter = RateLimiter::new(NonZeroU32::new(3).expect("non-zero"));
    let admitted = (0..10).filter(|_| limiter.admit("a").is_ok()).count();
    assert_eq!(admitted, 3);
    let wait = limiter.admit("a").expect_err("over the rate");
    assert!(
        wait > Duration::ZERO && wait <= Duration::from_millis(334),
        "the real wait for one more call at 3/s: {wait:?}"
    );
    assert!(
        limiter.admit("b").is_ok(),
        "each caller has a budget of its own"
    );
}

#[test]
fn an_admin_right_is_an_optional_fourth_field_and_old_lines_grant_none() {
    let (reader, reader_line) = new_token("dashboards", "team-a*", AdminRight::Read).expect("read");
    let (writer, writer_line) = new_token("oncall", "*", AdminRight::Write).expect("write");
    let (plain, plain_line) = new_token("orders", "*", AdminRight::None).expect("plain");
    assert!(
        reader_line.ends_with(" team-a* admin=read"),
        "{reader_line}"
    );
    assert!(writer_line.ends_with(" * admin=write"), "{writer_line}");
    assert_eq!(plain_line.split_whitespace().count(), 3, "today's format");
    let tokens = set(&[reader_line, writer_line, plain_line].join("\n"));
    let authenticator = |token: &str| tokens.authenticate(token).expect("known").clone();
    assert_eq!(authenticator(&reader).admin, AdminRight::Read);
    assert_eq!(authenticator(&writer).admin, AdminRight::Write);
    assert_eq!(authenticator(&plain).admin, AdminRight::None);
    for bad in ["admin=root", "admin", "read", "admin=write extra"] {
        let line = format!("x sha256:{} * {bad}", "ab".repeat(32));
        assert!(TokenSet::parse(&line).is_err(), "{bad:?} is refused");
    }
}

#[test]
fn an_admin_call_needs_the_right_and_the_scope() {
    let dir = std::env::temp_dir().join(format!("admin-rights-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a folder");
    let path = dir.join("tokens");
    let (reader, reader_line) = new_token("dashboards", "team-a*", AdminRight::Read).expect("read");
    let (plain, plain_line) = new_token("orders", "*", AdminRight::None).expect("plain");
    std::fs::write(&path, format!("{reader_line}\n{plain_line}\n")).expect("write");
    let authenticator = Authenticator::load(&path, None).expect("load");
    let caller = |token: &str| {
        authenticator
            .authenticate(Some(&format!("Bearer {token}")))
            .expect("known")
    };
    let (reader, plain) = (caller(&reader), caller(&plain));
    let denial = |result: Result<(), Refusal>| match result {
        Err(Refusal::PermissionDenied { denial, .. }) => Some(denial),
        Ok(()) => None,
        Err(other) => panic!("not a denial: {other:?}"),
    };
    let admin = |caller, scope, right| {
        denial(authenticator.authorize_admin(caller, scope, right, "ForceRelease"))
    };
    let out_of_scope = || Denial::Scope {
        scope: "team-b".into(),
    };
    let read_only = Denial::ReadOnly {
        method: "ForceRelease".into(),
    };
    for (caller, scope, right, expected) in [
        (&reader, "team-a1", AdminRight::Read, None),
        (&reader, "team-b", AdminRight::Read, Some(out_of_scope())),
        (&reader, "team-a1", AdminRight::Write, Some(read_only)),
        // The scope is judged before the right to write: the first thing to fix comes first.
        (&reader, "team-b", AdminRight::Write, Some(out_of_scope())),
        (
            &plain,
            "anything",
            AdminRight::Read,
            Some(Denial::NoAdminRight),
        ),
        (
            &plain,
            "anything",
            AdminRight::None,
            Some(Denial::NoAdminRight),
        ),
    ] {
        assert_eq!(
            admin(caller, scope, right),
            expected,
            "{} on {scope} for {right:?}",
            caller.name
        );
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_prefix_that_leaves_out_its_bare_name_is_told() {
    let left_out = |scopes: &str| bare_names_left_out(scopes).expect("valid scopes");
    assert_eq!(
        left_out("payments-*"),
        [("payments-*".to_owned(), "payments".to_owned())]
    );
    assert_eq!(
        left_out("billing,team_*,eu.*"),
        [
            ("team_*".to_owned(), "team".to_owned()),
            ("eu.*".to_owned(), "eu".to_owned())
        ]
    );
    for covered in [
        "payments,payments-*",
        "payments-*,payments",
        "pay*,payments-*",
        "*",
    ] {
        assert!(left_out(covered).is_empty(), "{covered}");
    }
    // A prefix without a separator covers its bare name itself.
    assert!(left_out("payments*").is_empty());
    assert!(bare_names_left_out("pay ments-*").is_err());
}
