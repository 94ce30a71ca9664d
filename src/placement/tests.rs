use super::*;

fn keyed(byte: u8) -> Hashing {
    Hashing::keyed([byte; 32])
}

fn moving(from: Hashing, to: Hashing, deploy: Deploy) -> Phase {
    Phase::of(&from.moving_to(to, deploy).unwrap())
}

/// The registry's entries of instances in `phases`, running now.
fn running(phases: &[&Phase]) -> Vec<String> {
    phases
        .iter()
        .flat_map(|phase| entries(phase, Duration::from_secs(1), Duration::from_secs(60)))
        .map(|(e, _)| e)
        .collect()
}

/// Only the records of instances in `phases`: they stopped.
fn wrote(phases: &[&Phase]) -> Vec<String> {
    running(phases).into_iter().filter(|entry| entry.starts_with("wrote:")).collect()
}

#[test]
fn neighbouring_deploys_of_a_move_run_side_by_side_and_no_others() {
    let old = Phase::of(&Hashing::plain());
    let first = moving(Hashing::plain(), keyed(1), Deploy::First);
    let second = moving(Hashing::plain(), keyed(1), Deploy::Second);
    let new = Phase::of(&keyed(1));
    let builds = [&old, &first, &second, &new];
    for (i, a) in builds.iter().enumerate() {
        for (j, b) in builds.iter().enumerate() {
            let refused = conflict(a, &running(&[b]));
            assert_eq!(refused.is_some(), i.abs_diff(j) > 1, "{a} beside {b}: {refused:?}");
        }
    }
    let skipped = conflict(&new, &running(&[&first])).unwrap();
    assert!(skipped.contains("`Deploy::Second`) is missing"), "{skipped}");
    let skipped = conflict(&second, &running(&[&old])).unwrap();
    assert!(skipped.contains("`Deploy::First`) is missing"), "{skipped}");
    let direct = conflict(&new, &running(&[&old])).unwrap();
    assert!(direct.contains("a move of three rolling deploys"), "{direct}");
    assert!(!direct.contains(&hex(&[1; 32])), "no secret in the message");
}

#[test]
fn a_deploy_after_another_stopped_must_read_what_it_completed() {
    let old = Phase::of(&Hashing::plain());
    let first = moving(Hashing::plain(), keyed(1), Deploy::First);
    let second = moving(Hashing::plain(), keyed(1), Deploy::Second);
    let new = Phase::of(&keyed(1));
    // The new naming alone while deploy 1's records live: refused.
    assert!(conflict(&new, &wrote(&[&first])).is_some());
    assert_eq!(conflict(&new, &wrote(&[&old, &second])).map(|_| ()), Some(()), "old's records");
    assert_eq!(conflict(&new, &wrote(&[&second])), None);
    // A rollback to the old naming alone while deploy 2's (or the new naming's) records live.
    let too_far = conflict(&old, &wrote(&[&second])).unwrap();
    assert!(too_far.contains("a rollback too far"), "{too_far}");
    assert!(conflict(&old, &wrote(&[&new])).is_some());
    assert_eq!(conflict(&old, &wrote(&[&first])), None);
    // The move's deploys read both namings: any of the four's records.
    for deploy in [&first, &second] {
        assert_eq!(conflict(deploy, &wrote(&[&old, &first, &second, &new])), None);
    }
}

#[test]
fn another_secret_or_a_second_move_is_refused() {
    let first = moving(Hashing::plain(), keyed(1), Deploy::First);
    let second = moving(Hashing::plain(), keyed(1), Deploy::Second);
    let other_secret = Phase::of(&keyed(2));
    assert!(conflict(&other_secret, &running(&[&second])).is_some());
    // A rotation begun while the move's first deploy runs (or its records live): it does not
    // read the plain names that deploy completes first.
    let rotation = moving(keyed(1), keyed(2), Deploy::First);
    let refused = conflict(&rotation, &running(&[&first])).unwrap();
    assert!(refused.contains("another move"), "{refused}");
    assert!(conflict(&first, &running(&[&rotation])).is_some());
    assert!(conflict(&rotation, &wrote(&[&first])).is_some());
    // Beside the second deploy, whose every request is complete under the keyed names first,
    // each reads what the other completes: the rule lets it (as deploy 3 would be).
    assert_eq!(conflict(&rotation, &running(&[&second])), None);
    // Another secret in the middle of the move: refused wherever one side completes under its
    // secret first (a first deploy's siblings all complete the plain names first, and read
    // them: no request is lost between them, and the next deploy is refused beside either).
    let changed_first = moving(Hashing::plain(), keyed(3), Deploy::First);
    let changed_second = moving(Hashing::plain(), keyed(3), Deploy::Second);
    assert!(conflict(&changed_second, &running(&[&first])).is_some());
    assert!(conflict(&changed_second, &running(&[&second])).is_some());
    assert!(conflict(&changed_first, &running(&[&second])).is_some());
    assert_eq!(conflict(&changed_first, &running(&[&first])), None);
    assert!(conflict(&second, &wrote(&[&changed_first])).is_none());
    assert!(conflict(&Phase::of(&keyed(1)), &wrote(&[&changed_first])).is_some());
    assert_ne!(NamingId::of_test(&keyed(1)), NamingId::of_test(&keyed(2)));
}

#[test]
fn labels_read_back_and_an_unknown_entry_is_refused() {
    let phases = [
        Phase::of(&Hashing::plain()),
        Phase::of(&keyed(1)),
        moving(Hashing::plain(), keyed(1), Deploy::First),
        moving(keyed(1), keyed(2), Deploy::Second),
    ];
    for phase in &phases {
        assert_eq!(Phase::parse(&phase.label()).as_ref(), Some(phase));
    }
    let unknown = conflict(&phases[0], &["running:regions=eu,us".to_owned()]).unwrap();
    assert!(unknown.contains("does not know"), "{unknown}");
    assert_eq!(conflict(&phases[0], &["other:x".to_owned()]), None, "not a phase's entry");
}

#[test]
fn an_instance_starting_counts_only_if_the_running_fleet_would_let_it_start() {
    let old = Phase::of(&Hashing::plain());
    let first = moving(Hashing::plain(), keyed(1), Deploy::First);
    let new = Phase::of(&keyed(1));
    let starting = |phase: &Phase| format!("starting:{}", phase.label());
    // Two starting at once, nothing running: the one that reads second is refused.
    assert!(conflict(&old, &[starting(&new)]).is_some());
    // A deploy-1 instance scaling up beside deploy 1, while a skipped deploy 3 instance was
    // refused a moment ago: its starting entry is refused already, and refuses nobody.
    let listed = [running(&[&first]), vec![starting(&new)]].concat();
    assert_eq!(conflict(&first, &listed), None);
    assert_eq!(conflict(&old, &listed), None);
}
