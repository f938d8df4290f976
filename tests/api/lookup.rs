use crate::support::*;

async fn lookup_reports_all_three_states_without_changing_them(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let key = unique_key("lookup");

    assert!(is_absent(&client, &key).await);
    assert_eq!(
        app.total_rows().await,
        0,
        "Lookup of an absent key creates nothing"
    );

    let started = claim(&mut client, try_start(&key).with_lease(secs(10))).await;
    for _ in 0..2 {
        let held = looked_up_in_progress(&client, &key).await;
        assert_eq!(held.lease_expires_at, started.lease_expires_at);
        assert_eq!(held.attempt, 1);
        assert_eq!(held.fingerprint, FINGERPRINT);
    }

    let completion = complete_key(&client, &key, started.lease_token, b"result").await;
    assert_stored(&client, &key, b"result", &completion).await;
}

for_each_backend!(lookup_reports_all_three_states_without_changing_them,);
