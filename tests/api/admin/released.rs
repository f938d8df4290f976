//! A key an operator released (ForceRelease) is shown as released, not stuck, until the next
//! claim takes it over: in the API's listings (its own state, and not among the stuck keys),
//! its record (who released it, when) and the namespace's counts; and in the CLI's `keys list`,
//! `keys show` and `stats`, which also say what happens next. Once claimed again it is in
//! progress, with nothing of the release left on it.

use serde_json::Value;

use super::cli::{admin, admin_json, list_with, release};
use super::*;

/// The keys of a listing's JSON, by name.
fn keys_of(listing: &Value) -> Vec<&str> {
    listing["keys"]
        .as_array()
        .expect("a list of keys")
        .iter()
        .map(|key| key["key"].as_str().expect("a key's name"))
        .collect()
}

async fn a_released_key_is_shown_as_released_until_the_next_claim_takes_it_over(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let admin_api = admin_client(&app).await;
    let crashed = claim_and_let_lapse(&app, &mut client, try_start("crashed")).await;
    claim_and_let_lapse(&app, &mut client, try_start("lapsed")).await;

    let run = admin(&app, &release("crashed", "worker crashed, INC-1")).await;
    assert_eq!(run.status, Some(0), "{}", run.stderr);
    let lines: Vec<&str> = run.stdout.lines().collect();
    assert!(
        lines[0].starts_with("released crashed (was stuck, attempt 1"),
        "{}",
        run.stdout
    );
    assert_eq!(
        lines[1],
        "nobody holds it now: its holder's writes are refused (LEASE_LOST) and the next claim \
         takes it over (a greater token, attempt + 1); until then it is listed as released, not \
         stuck"
    );

    // The stuck keys are the ones nobody has dealt with; the released one is listed as such.
    let stuck = admin_json(&app, &list_with("--state", "stuck")).await;
    assert_eq!(keys_of(&stuck), ["lapsed"], "{stuck}");
    let released = admin_json(&app, &list_with("--state", "released")).await;
    assert_eq!(keys_of(&released), ["crashed"], "{released}");
    let entry = &released["keys"][0];
    assert_eq!(entry["state"], "released");
    assert_eq!(entry["released_by"], "loopback");
    assert!(entry["lease_token"].as_u64() > Some(crashed.lease_token));
    let at = entry["released_at"].as_str().expect("when it was released");
    assert!(
        at.ends_with('Z') && chrono::DateTime::parse_from_rfc3339(at).is_ok(),
        "{at}"
    );
    // By key order (a prefix), the state filter is the same.
    let mut by_prefix = list_with("--state", "released");
    by_prefix.extend(["--prefix", "cr"]);
    assert_eq!(keys_of(&admin_json(&app, &by_prefix).await), ["crashed"]);
    let all = admin_json(&app, &["keys", "list", "--namespace", NAMESPACE]).await;
    let states: Vec<(&str, &str)> = all["keys"]
        .as_array()
        .expect("keys")
        .iter()
        .map(|k| {
            (
                k["key"].as_str().unwrap_or(""),
                k["state"].as_str().unwrap_or(""),
            )
        })
        .collect();
    assert_eq!(states, [("crashed", "released"), ("lapsed", "stuck")]);
    // The API says the same.
    let api_stuck = listed(&admin_api, list(pb::AdminKeyState::Stuck)).await;
    assert_eq!(names(&api_stuck), ["lapsed"]);
    let api_released = listed(&admin_api, list(pb::AdminKeyState::Released)).await;
    assert_eq!(names(&api_released), ["crashed"]);
    assert_eq!(api_released[0].state(), pb::AdminKeyState::Released);
    assert_eq!(api_released[0].released_by, "loopback");
    assert!(api_released[0].released_at.is_some());
    assert!(api_released[0].holder.is_empty());

    // Its record says who released it, when, and what comes next.
    let show = admin(
        &app,
        &["keys", "show", "--namespace", NAMESPACE, "--key", "crashed"],
    )
    .await;
    assert_eq!(show.status, Some(0), "{}", show.stderr);
    show.assert_printed(&[
        "state              released\n",
        "released_by        loopback\n",
        &format!("released_at        {at}\n"),
        "next               nobody holds it now: its holder's writes are refused",
    ]);

    // The counts: one stuck (the oldest is the one nobody dealt with), one released.
    let stats = admin_json(&app, &["stats", "--namespace", NAMESPACE]).await;
    assert_eq!(
        (
            &stats["stuck_keys"],
            &stats["released_keys"],
            &stats["in_progress_keys"]
        ),
        (&Value::from(1), &Value::from(1), &Value::from(0)),
        "{stats}"
    );
    assert_eq!(stats["oldest_stuck_key"], "lapsed");
    let table = admin(&app, &["stats", "--namespace", NAMESPACE]).await;
    assert!(
        table.stdout.contains("\nstuck             1\n")
            && table.stdout.contains("\nreleased          1\n"),
        "{}",
        table.stdout
    );

    // The next claim takes it over; it is then in progress, and nothing says released.
    let next = claim(&mut client, try_start("crashed")).await;
    assert!(next.lease_token > crashed.lease_token);
    assert_eq!(next.attempt, 2);
    let released = admin_json(&app, &list_with("--state", "released")).await;
    assert!(keys_of(&released).is_empty(), "{released}");
    let entry = admin_api
        .clone()
        .get_key(get_key("crashed"))
        .await
        .expect("the key")
        .into_inner()
        .key
        .expect("its entry");
    assert_eq!(entry.state(), pb::AdminKeyState::InProgress);
    assert!(entry.released_by.is_empty() && entry.released_at.is_none());
    let stats = admin_json(&app, &["stats", "--namespace", NAMESPACE]).await;
    assert_eq!(
        (&stats["released_keys"], &stats["in_progress_keys"]),
        (&Value::from(0), &Value::from(1)),
        "{stats}"
    );
}

for_each_backend!(a_released_key_is_shown_as_released_until_the_next_claim_takes_it_over,);
