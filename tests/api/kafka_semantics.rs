//! The Kafka production runs, under test: `kafka.broker_quirks = "none"` and
//! the idempotent producer on, against librdkafka's mock cluster (brokers in
//! this process that implement Kafka's idempotent producer and its group
//! protocol as librdkafka's own tests rely on them), with the mock's faults: a
//! broker down, request errors, acknowledgements lost or late after the write,
//! a coordinator move. Every other test runs against the real test broker,
//! tansu 0.6, under `broker_quirks = "tansu-0.6"`. The one test here that
//! needs no fault injection runs on both.

use std::collections::HashSet;
use std::time::Duration;

use flashsale::kafka::{GroupProbe, PartitionOffsets};
use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
use reqwest::StatusCode;
use testkit::invariants::Answer;

use crate::helpers::{
    eventually, read_topic_on, unique, Caller, Flood, MockKafka, Sale, TestApp, TestAppBuilder,
    WAIT,
};

/// Each user reserves once, all at the same time; their answers in order.
async fn reserve_all(app: &TestApp, sale: &Sale, users: &[String]) -> Vec<Answer> {
    let tasks: Vec<_> = users
        .iter()
        .map(|u| {
            let (api, sku, u) = (app.api.clone(), sale.sku.clone(), u.clone());
            tokio::spawn(async move {
                Answer::from_response(api.reserve(&sku, Caller::User(&u)).send().await).await
            })
        })
        .collect();
    let mut answers = Vec::with_capacity(tasks.len());
    for t in tasks {
        answers.push(t.await.expect("reserve task"));
    }
    answers
}

fn users(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i}")).collect()
}

/// The sale quiet, then every invariant checked against these answers.
async fn quiet_and_sound(
    app: &TestApp,
    sale: &Sale,
    answers: &[Answer],
) -> testkit::invariants::Figures {
    let probe = app.probe(sale);
    probe.wait_quiet(WAIT).await.expect("the sale goes quiet");
    probe.check(answers).await.expect("the invariants hold")
}

/// How many messages on the reservation topic carry this reservation.
async fn copies(app: &TestApp, reservation_id: &str) -> usize {
    read_topic_on(&app.settings.kafka.brokers, &app.settings.kafka.topic)
        .await
        .iter()
        .filter(|m| m.reservation_id == reservation_id)
        .count()
}

/// A crowd on production's settings: the producer is idempotent (it asked the
/// brokers for a producer id), every `202` became one order, no unit sold twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn production_settings_sell_each_unit_once() {
    let mock = MockKafka::start(3);
    let app = TestApp::builder().workers().mock_kafka(&mock).spawn().await;
    let sale = app.open_sale(20, 1).await;
    let answers = reserve_all(&app, &sale, &users("crowd", 60)).await;
    let f = quiet_and_sound(&app, &sale, &answers).await;
    assert_eq!(f.accepted, 20, "{f:?}");
    assert_eq!(f.accepted_ordered, 20, "{f:?}");
    assert!(
        mock.requests(RDKafkaApiKey::InitProducerId) >= 1,
        "the producer never asked for a producer id: it is not idempotent"
    );
    app.stop().await;
}

/// A produce written, its acknowledgement lost with its connection, and the
/// produce retried; `retry` is what the broker answers the retry.
async fn acknowledgement_lost(retry: Option<RDKafkaRespErr>) -> (usize, i64) {
    let mock = MockKafka::start(1);
    let app = TestApp::builder()
        .workers()
        .mock_kafka(&mock)
        .publish_timeout_ms(10_000)
        .spawn()
        .await;
    let sale = app.open_sale(5, 1).await;
    let mut answers = reserve_all(&app, &sale, &users("warm", 1)).await;
    assert_eq!(answers[0].status, Some(202));
    let produced = mock.requests(RDKafkaApiKey::Produce);
    // Written at once, answered in 3 s: the connection closes before that.
    let mut script = vec![(
        RDKafkaRespErr::RD_KAFKA_RESP_ERR_NO_ERROR,
        Duration::from_secs(3),
    )];
    script.extend(retry.map(|e| (e, Duration::ZERO)));
    mock.answer_from(1, RDKafkaApiKey::Produce, &script);
    let buyer = {
        let (api, sku) = (app.api.clone(), sale.sku.clone());
        tokio::spawn(async move {
            Answer::from_response(api.reserve(&sku, Caller::User("buyer")).send().await).await
        })
    };
    eventually(WAIT, "the produce reached the broker", || async {
        (mock.requests(RDKafkaApiKey::Produce) > produced).then_some(())
    })
    .await;
    mock.down(1);
    tokio::time::sleep(Duration::from_millis(300)).await;
    mock.up(1);
    let answer = buyer.await.expect("buyer");
    assert_eq!(answer.status, Some(202), "{answer:?}");
    assert!(
        mock.requests(RDKafkaApiKey::Produce) >= produced + 2,
        "the produce was never retried"
    );
    answers.push(answer.clone());
    let f = quiet_and_sound(&app, &sale, &answers).await;
    assert_eq!((f.accepted, f.accepted_ordered), (2, 2), "{f:?}");
    let (status, body) = app.reservation_state(&sale.sku, "buyer").await;
    assert_eq!(
        (status, body["status"].as_str()),
        (StatusCode::OK, Some("ordered"))
    );
    let reservation = answer.reservation_id.clone().expect("reservation id");
    let counts = app.order_counts(&sale.id).await;
    let result = (copies(&app, &reservation).await, counts.values().sum());
    app.stop().await;
    result
}

/// The retry answered `DUPLICATE_SEQUENCE_NUMBER` (the broker had the write;
/// tansu's successor answers so, with offset -1, where Kafka returns the first
/// offset): the publish is a success, one message, one order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_retried_produce_answered_duplicate_sequence_is_a_success() {
    let (copies, orders) = acknowledgement_lost(Some(
        RDKafkaRespErr::RD_KAFKA_RESP_ERR_DUPLICATE_SEQUENCE_NUMBER,
    ))
    .await;
    assert_eq!((copies, orders), (1, 2));
}

/// The retry written a second time (the mock checks sequences for a
/// transactional producer only; a broker without idempotence does the same):
/// two messages, still one order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_produce_written_twice_is_still_one_order() {
    let (copies, orders) = acknowledgement_lost(None).await;
    assert_eq!((copies, orders), (2, 2));
}

/// A produce written whose acknowledgement comes after the publish timeout:
/// the request gives it up and settles it through MySQL, and the message that
/// is in the topic all the same never makes an order behind that answer. With
/// no consumer running the withdrawal comes first (`503`, the unit back);
/// with one running, either the order or the withdrawal, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_publish_acknowledged_too_late_is_decided_once() {
    let mock = MockKafka::start(1);
    let app = TestApp::builder()
        .mock_kafka(&mock)
        .publish_timeout_ms(1500)
        .spawn()
        .await;
    let sale = app.open_sale(5, 1).await;
    let mut answers = reserve_all(&app, &sale, &users("warm", 1)).await;
    let late = [(
        RDKafkaRespErr::RD_KAFKA_RESP_ERR_NO_ERROR,
        Duration::from_secs(5),
    )];
    mock.answer_from(1, RDKafkaApiKey::Produce, &late);
    let first = reserve_all(&app, &sale, &users("late", 1)).await;
    assert_eq!(first[0].status, Some(503), "{:?}", first[0]);
    answers.extend(first);
    // The consumer starts: it reads the message the broker kept.
    let consumer = TestApp::builder()
        .workers()
        .database_of(&app)
        .kafka_of(&app)
        .spawn()
        .await;
    mock.answer_from(1, RDKafkaApiKey::Produce, &late);
    let second = reserve_all(&app, &sale, &users("late-again", 1)).await;
    assert!(
        matches!(second[0].status, Some(202 | 503)),
        "{:?}",
        second[0]
    );
    answers.extend(second.iter().cloned());
    let f = quiet_and_sound(&consumer, &sale, &answers).await;
    let ordered_again = usize::from(second[0].status == Some(202));
    assert_eq!(f.accepted_ordered, 1 + ordered_again, "{f:?}");
    let counts = consumer.order_counts(&sale.id).await;
    assert_eq!(counts.values().sum::<i64>(), 1 + ordered_again as i64);
    // Both messages reached the topic.
    assert_eq!(
        read_topic_on(&app.settings.kafka.brokers, &app.settings.kafka.topic)
            .await
            .len(),
        3
    );
    assert_eq!(
        app.probe(&sale).units_left().await.expect("units"),
        Some(4 - ordered_again as i64)
    );
    consumer.stop().await;
    app.stop().await;
}

/// A crowd through request errors, a coordinator that moves twice and a
/// broker down for two seconds: every `202` becomes an order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn brokers_failing_under_a_crowd_break_no_promise() {
    let mock = MockKafka::start(3);
    let app = TestApp::builder().workers().mock_kafka(&mock).spawn().await;
    let sale = app.open_sale(400, 1).await;
    let flood = Flood::start(&app, &sale.sku, 8);
    let more = |n: usize| {
        let target = flood.accepted() + n;
        let flood = &flood;
        async move {
            eventually(WAIT, "more 202s", || async {
                (flood.accepted() >= target).then_some(())
            })
            .await
        }
    };
    more(20).await;
    mock.answer_next(
        RDKafkaApiKey::Produce,
        &[
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_LEADER_FOR_PARTITION,
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_REQUEST_TIMED_OUT,
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS,
        ],
    );
    more(20).await;
    let group = &app.settings.kafka.group_id;
    mock.move_coordinator(group, 2);
    more(20).await;
    mock.move_coordinator(group, 3);
    mock.down(1);
    tokio::time::sleep(Duration::from_secs(2)).await;
    mock.up(1);
    more(20).await;
    let answers = flood.stop().await;
    let f = quiet_and_sound(&app, &sale, &answers).await;
    assert!(f.accepted >= 80, "{f:?}");
    assert_eq!(f.accepted_ordered, f.accepted, "{f:?}");
    app.stop().await;
}

/// Each partition's committed offset and lag for the app's group.
async fn partitions(app: &TestApp) -> Vec<PartitionOffsets> {
    let kafka = app.settings.kafka.clone();
    tokio::task::spawn_blocking(move || {
        GroupProbe::new(&kafka)
            .and_then(|p| p.read(Duration::from_secs(3)))
            .expect("the group's offsets")
    })
    .await
    .expect("probe task")
}

/// Partitions whose backlog stood still for two seconds.
async fn standing(app: &TestApp) -> HashSet<i32> {
    let before = partitions(app).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = partitions(app).await;
    after
        .iter()
        .filter(|p| {
            p.lag > 0
                && before
                    .iter()
                    .any(|b| b.partition == p.partition && b.committed == p.committed)
        })
        .map(|p| p.partition)
        .collect()
}

/// A group whose one member MySQL may refuse: `first` (root, not consuming)
/// made the database; `refused` consumes as a user of its own, whose `INSERT`
/// on `orders` [`Refusal::refuse`] revokes and [`Refusal::grant`] gives back.
struct Refusal {
    first: TestApp,
    refused: TestApp,
    user: String,
    db: String,
}

impl Refusal {
    async fn start(lane: &impl Fn(TestAppBuilder) -> TestAppBuilder) -> Self {
        let first = lane(TestApp::builder()).spawn().await;
        let db: String = sqlx::query_scalar("SELECT DATABASE()")
            .fetch_one(&first.state.pool)
            .await
            .expect("database name");
        let mut user = unique("fs_");
        user.truncate(30);
        let r = |sql: String| Refusal::admin_on(&first, sql);
        r(format!("CREATE USER '{user}'@'%' IDENTIFIED BY 'pw'")).await;
        r(format!("GRANT SELECT, UPDATE, DELETE, CREATE, ALTER, INDEX, DROP, LOCK TABLES, CREATE TEMPORARY TABLES ON `{db}`.* TO '{user}'@'%'")).await;
        let tables: Vec<String> = sqlx::query_scalar(
            "SELECT CAST(table_name AS CHAR) FROM information_schema.tables WHERE table_schema = ?",
        )
        .bind(&db)
        .fetch_all(&first.state.pool)
        .await
        .expect("tables");
        for t in tables {
            r(format!("GRANT INSERT ON `{db}`.`{t}` TO '{user}'@'%'")).await;
        }
        let refused = TestApp::builder()
            .workers()
            .database_of(&first)
            .kafka_of(&first)
            .mysql_user(&user, "pw")
            .spawn()
            .await;
        Refusal {
            first,
            refused,
            user,
            db,
        }
    }

    async fn admin_on(app: &TestApp, sql: String) {
        sqlx::query(&sql)
            .execute(&app.state.pool)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    /// Another consuming member of the group.
    async fn another_member(&self) -> TestApp {
        TestApp::builder()
            .workers()
            .database_of(&self.first)
            .kafka_of(&self.first)
            .spawn()
            .await
    }

    /// MySQL refuses the member's orders (`INSERT` on `orders` revoked).
    async fn refuse(&self) {
        let (db, user) = (&self.db, &self.user);
        Refusal::admin_on(
            &self.first,
            format!("REVOKE INSERT ON `{db}`.`orders` FROM '{user}'@'%'"),
        )
        .await;
    }

    /// MySQL lets the refused member write its orders.
    async fn grant(&self) {
        let (db, user) = (&self.db, &self.user);
        Refusal::admin_on(
            &self.first,
            format!("GRANT INSERT ON `{db}`.`orders` TO '{user}'@'%'"),
        )
        .await;
    }

    async fn stop(self) {
        self.refused.stop().await;
        let user = &self.user;
        Refusal::admin_on(&self.first, format!("DROP USER '{user}'@'%'")).await;
        self.first.stop().await;
    }
}

/// One member of the group cannot write orders (MySQL refuses its `INSERT`)
/// and holds every partition, retrying; a second member joins. The refused
/// member keeps polling, so the rebalance completes at once and the second
/// member drains what it took (every partition stood behind the refused one
/// before, so a drained one proves the rebalance). A member that stopped
/// polling would hold up the rebalance, and every partition with it, until
/// `max.poll.interval.ms`: on tansu nothing then drains here. (librdkafka's
/// mock coordinator does not wait for a member that has not rejoined: it
/// completes the rebalance without it, so there this half passes either way.)
/// Then the second member stops and its partitions come back to the refused
/// one; once MySQL lets it write, it reads them too (a partition paused here
/// stays paused through a rebalance unless resumed, and one handed back paused
/// would never be read again), and every `202` is one order.
async fn a_member_refused_by_mysql_holds_up_no_rebalance(
    lane: impl Fn(TestAppBuilder) -> TestAppBuilder,
) {
    let group = Refusal::start(&lane).await;
    let first = &group.first;
    let all = first.settings.kafka.partitions as usize;
    let sale = first.open_sale(300, 1).await;
    // The only consumer, still let in: once it has committed on every
    // partition it holds them all. Then MySQL refuses it.
    let mut answers = Vec::new();
    let deadline = std::time::Instant::now() + WAIT;
    for round in 0.. {
        assert!(
            std::time::Instant::now() < deadline,
            "the refused member never committed on every partition"
        );
        answers.extend(reserve_all(first, &sale, &users(&format!("warm-{round}"), 10)).await);
        let held = eventually(WAIT, "the warm-up ordered", || async {
            let p = partitions(first).await;
            p.iter().all(|p| p.lag == 0).then_some(p)
        })
        .await;
        if held.iter().all(|p| p.committed > 0) {
            break;
        }
    }
    group.refuse().await;
    answers.extend(reserve_all(first, &sale, &users("before", 30)).await);
    eventually(
        WAIT,
        "every partition stuck behind the refused member",
        || async { (standing(first).await.len() == all).then_some(()) },
    )
    .await;
    let helper = group.another_member().await;
    let rebalanced = Duration::from_secs(30);
    eventually(
        rebalanced,
        "the second member drained what it took",
        || async {
            partitions(first)
                .await
                .iter()
                .any(|p| p.lag == 0)
                .then_some(())
        },
    )
    .await;
    helper.stop().await;
    group.grant().await;
    answers.extend(reserve_all(first, &sale, &users("after", 30)).await);
    let f = quiet_and_sound(first, &sale, &answers).await;
    assert_eq!(f.accepted_ordered, f.accepted, "{f:?}");
    assert!(f.accepted >= 70, "{f:?}");
    group.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_refused_by_mysql_holds_up_no_rebalance_on_kafkas_protocol() {
    let mock = MockKafka::start(3);
    a_member_refused_by_mysql_holds_up_no_rebalance(|b| b.mock_kafka(&mock)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_refused_by_mysql_holds_up_no_rebalance_on_the_test_broker() {
    a_member_refused_by_mysql_holds_up_no_rebalance(|b| b).await;
}
