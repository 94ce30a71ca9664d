//! [`Direct`] against a server played by the test: what it writes when, and what each caller
//! gets back, whatever the server does.

use std::time::Duration;

use deadpool_redis::redis::{
    ErrorKind, IntoConnectionInfo, ServerErrorKind, Value, cmd,
    io::tcp::{TcpSettings, socket2},
    pipe,
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
};

use super::*;

/// A server on a free loopback port, and the connection info to reach it.
async fn server() -> (TcpListener, ConnectionInfo) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("redis://{}", listener.local_addr().unwrap());
    (listener, url.into_connection_info().unwrap())
}

/// A connection made to the played server, and the server's end of it.
async fn connected() -> (Direct, TcpStream) {
    let (listener, info) = server().await;
    let (direct, accepted) = tokio::join!(Direct::connect(&info), listener.accept());
    (direct.unwrap(), accepted.unwrap().0)
}

/// Reads `count` whole commands (arrays of bulk strings, which read as replies do): each as
/// the strings of its arguments.
async fn commands(server: &mut TcpStream, count: usize) -> Vec<Vec<String>> {
    let (mut bytes, mut commands) = (Vec::new(), Vec::new());
    while commands.len() < count {
        let mut chunk = vec![0; 64 * 1024];
        let read = tokio::time::timeout(Duration::from_secs(5), server.read(&mut chunk))
            .await
            .expect("the commands within 5 s")
            .unwrap();
        assert_ne!(read, 0, "the client closed the connection");
        bytes.extend_from_slice(&chunk[..read]);
        while let Some((Value::Array(args), used)) = reply::read(&bytes).unwrap() {
            let text = |arg: Value| match arg {
                Value::BulkString(arg) if arg.len() > 64 => format!("<{} bytes>", arg.len()),
                Value::BulkString(arg) => String::from_utf8(arg).unwrap(),
                other => panic!("{other:?}"),
            };
            commands.push(args.into_iter().map(text).collect());
            bytes.drain(..used);
        }
    }
    assert!(bytes.is_empty(), "more than {count} commands");
    commands
}

fn get(key: &str) -> Cmd {
    cmd("GET").arg(key).clone()
}

#[tokio::test]
async fn each_reply_reaches_its_own_command_even_after_a_caller_stopped_waiting() {
    let (direct, mut server) = connected().await;
    let first = tokio::spawn({
        let direct = direct.clone();
        async move { direct.request(&get("a")).await }
    });
    assert_eq!(commands(&mut server, 1).await, [["GET", "a"]]);
    // Sent while the first waits: they go out when its reply comes in.
    let (second, third) = (get("b"), get("c"));
    let gave_up = tokio::time::timeout(Duration::from_millis(50), direct.request(&second)).await;
    assert!(gave_up.is_err());
    let third = tokio::spawn({
        let direct = direct.clone();
        async move { direct.request(&third).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut nothing = [0; 1];
    assert!(server.try_read(&mut nothing).is_err(), "written before the first reply came in");
    server.write_all(b":1\r\n").await.unwrap();
    assert_eq!(commands(&mut server, 2).await, [["GET", "b"], ["GET", "c"]]);
    server.write_all(b"$3\r\nbee\r\n*2\r\n:3\r\n$-1\r\n").await.unwrap();
    assert_eq!(first.await.unwrap().unwrap(), Value::Int(1));
    let third = third.await.unwrap().unwrap();
    assert_eq!(third, Value::Array(vec![Value::Int(3), Value::Nil]));
    assert!(!direct.is_lost());
}

#[tokio::test]
async fn a_command_larger_than_the_socket_takes_goes_out_whole_before_the_next() {
    let (direct, mut server) = connected().await;
    let large = vec![b'x'; 8 << 20];
    let set = cmd("SET").arg("k").arg(&large[..]).clone();
    let sending = tokio::spawn({
        let direct = direct.clone();
        async move { direct.request(&set).await }
    });
    // Queued behind the large one while the server reads nothing: it follows it out whole.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let after = tokio::spawn({
        let direct = direct.clone();
        async move { direct.request(&get("k")).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let seen = commands(&mut server, 2).await;
    assert_eq!(seen, [vec!["SET", "k", "<8388608 bytes>"], vec!["GET", "k"]]);
    server.write_all(b"+OK\r\n$1\r\nv\r\n").await.unwrap();
    assert_eq!(sending.await.unwrap().unwrap(), Value::Okay);
    assert_eq!(after.await.unwrap().unwrap(), Value::BulkString(b"v".to_vec()));
}

#[tokio::test]
async fn a_large_commands_buffer_is_given_back_and_a_small_ones_kept() {
    let (direct, mut server) = connected().await;
    let capacity = || direct.handles.0.state().out.capacity();
    let set = cmd("SET").arg("k").arg(&vec![b'x'; 4 << 20][..]).clone();
    let (reply, ()) = tokio::join!(direct.request(&set), async {
        commands(&mut server, 1).await;
        server.write_all(b"+OK\r\n").await.unwrap();
    });
    assert_eq!(reply.unwrap(), Value::Okay);
    assert_eq!(capacity(), 0, "the large command's buffer is kept");
    let a = get("a");
    let (reply, ()) = tokio::join!(direct.request(&a), async {
        commands(&mut server, 1).await;
        server.write_all(b":1\r\n").await.unwrap();
    });
    assert_eq!(reply.unwrap(), Value::Int(1));
    assert!(capacity() > 0, "a small command's buffer is given back");
}

#[tokio::test]
async fn a_write_that_fails_fails_its_waiters_and_does_not_spin() {
    // The server closes without reading a command larger than the socket takes: the rest of
    // it, written by the connection's task, fails.
    let (direct, server) = connected().await;
    let set = cmd("SET").arg("k").arg(&vec![b'x'; 16 << 20][..]).clone();
    let (reply, ()) =
        tokio::join!(tokio::time::timeout(Duration::from_secs(5), direct.request(&set)), async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            // Unread bytes make the close a reset.
            drop(server);
        });
    assert!(reply.expect("an answer within 5 s").is_err());
    assert!(direct.is_lost());
}

#[tokio::test]
async fn a_read_that_fails_fails_its_waiters_and_does_not_spin() {
    // The server closes with the command unread: a reset, which the connection's read meets.
    let (direct, server) = connected().await;
    let a = get("a");
    let (reply, ()) =
        tokio::join!(tokio::time::timeout(Duration::from_secs(5), direct.request(&a)), async {
            // Until the command arrived, unread.
            server.readable().await.unwrap();
            drop(server);
        });
    let error = reply.expect("an answer within 5 s").unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Io, "{error}");
    // Told from a clean close, for whoever reads the logs.
    assert!(error.to_string().contains("reading a reply failed"), "{error}");
    assert!(direct.is_lost());
}

#[tokio::test]
async fn a_reply_after_a_large_one_in_the_same_read_is_kept_whole() {
    // A reply larger than the read buffer kept, with the start of the next behind it: the
    // buffer is given back only once nothing is left in it.
    let (direct, mut server) = connected().await;
    let (a, b) = (get("a"), get("b"));
    let large = vec![b'r'; 2 << 20];
    let (first, second, ()) = tokio::join!(direct.request(&a), direct.request(&b), async {
        commands(&mut server, 1).await;
        let mut bytes = format!("${}\r\n", large.len()).into_bytes();
        bytes.extend_from_slice(&large);
        bytes.extend_from_slice(b"\r\n$6\r\nsec");
        server.write_all(&bytes).await.unwrap();
        commands(&mut server, 1).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        server.write_all(b"ond\r\n").await.unwrap();
    });
    assert!(first.unwrap() == Value::BulkString(large), "the large reply");
    assert_eq!(second.unwrap(), Value::BulkString(b"second".to_vec()));
}

#[test]
fn a_connection_whose_runtime_ended_is_lost_to_the_commands_of_another() {
    let first = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let (direct, _server) = first.block_on(connected());
    let second = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let a = get("a");
    let pending = second.block_on(async {
        tokio::time::timeout(Duration::from_millis(50), direct.request(&a)).await
    });
    assert!(pending.is_err(), "answered while the server said nothing");
    assert!(!direct.is_lost());
    // Its task ends with it: the commands of another runtime fail at once, not at a deadline.
    drop(first);
    assert!(direct.is_lost());
    let after = second
        .block_on(async { tokio::time::timeout(Duration::from_secs(5), direct.request(&a)).await });
    assert!(after.expect("at once").is_err());
}

#[tokio::test]
async fn a_server_error_is_the_commands_alone() {
    let (direct, mut server) = connected().await;
    let (a, b) = (get("a"), get("b"));
    let both = tokio::join!(direct.request(&a), direct.request(&b), async {
        commands(&mut server, 2).await;
        server.write_all(b"-NOSCRIPT No matching script\r\n:2\r\n").await.unwrap();
    });
    let error = both.0.unwrap().extract_error().unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Server(ServerErrorKind::NoScript), "{error}");
    assert_eq!(both.1.unwrap(), Value::Int(2));
    assert!(!direct.is_lost());
}

#[tokio::test]
async fn a_connection_the_server_closed_fails_its_waiters_and_every_command_after() {
    let (direct, mut server) = connected().await;
    let a = get("a");
    let (waiting, ()) = tokio::join!(direct.request(&a), async {
        commands(&mut server, 1).await;
        drop(server);
    });
    let error = waiting.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Io, "{error}");
    assert!(direct.is_lost());
    let after = direct.request(&get("b")).await.unwrap_err();
    assert!(after.to_string().contains("closed the connection"), "{after}");
}

#[tokio::test]
async fn bytes_that_are_no_reply_and_replies_nobody_asked_for_lose_the_connection() {
    for (sent, why) in [(&b"?what\r\n"[..], "not a reply"), (b":1\r\n:2\r\n", "nobody asked for")] {
        let (direct, mut server) = connected().await;
        let a = get("a");
        let (waiting, ()) = tokio::join!(direct.request(&a), async {
            commands(&mut server, 1).await;
            server.write_all(sent).await.unwrap();
        });
        if why == "not a reply" {
            let error = waiting.unwrap_err();
            assert!(error.to_string().contains(why), "{error}");
        } else {
            assert_eq!(waiting.unwrap(), Value::Int(1));
        }
        tokio::time::timeout(Duration::from_secs(5), async {
            while !direct.is_lost() {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the connection found lost");
        let after = direct.request(&get("b")).await.unwrap_err();
        assert!(after.to_string().contains(why), "{after}");
    }
}

#[tokio::test]
async fn the_last_handle_dropped_closes_the_connection() {
    let (direct, mut server) = connected().await;
    let clone = direct.clone();
    drop(direct);
    let mut byte = [0; 1];
    let early = tokio::time::timeout(Duration::from_millis(50), server.read(&mut byte)).await;
    assert!(early.is_err(), "closed while a handle was left");
    drop(clone);
    let read = tokio::time::timeout(Duration::from_secs(5), server.read(&mut byte)).await;
    assert_eq!(read.expect("closed within 5 s").unwrap(), 0);
}

#[tokio::test]
async fn a_pipeline_gets_the_replies_it_asks_for_and_a_transaction_none() {
    let (direct, mut server) = connected().await;
    let mut pipeline = pipe();
    pipeline.add_command(get("a")).add_command(get("b")).add_command(get("c"));
    // Written at once, although the first's reply has not come in.
    let (values, ()) = tokio::join!(direct.request_all(&pipeline, 1, 1), async {
        commands(&mut server, 3).await;
        server.write_all(b":1\r\n:2\r\n:3\r\n").await.unwrap();
    });
    assert_eq!(values.unwrap(), [Value::Int(2)]);
    let (values, ()) = tokio::join!(direct.request_all(&pipeline, 0, 3), async {
        commands(&mut server, 3).await;
        server.write_all(b":1\r\n:2\r\n:3\r\n").await.unwrap();
    });
    assert_eq!(values.unwrap(), [Value::Int(1), Value::Int(2), Value::Int(3)]);
    pipeline.atomic();
    assert!(direct.request_all(&pipeline, 0, 1).await.is_err());
}

#[tokio::test]
async fn connecting_signs_in_and_selects_the_database_of_the_url() {
    let cases: [(&str, &[&[&str]]); 3] = [
        ("redis://127.0.0.1:{}", &[]),
        ("redis://:pw@127.0.0.1:{}", &[&["AUTH", "pw"]]),
        ("redis://u:pw@127.0.0.1:{}/3", &[&["AUTH", "u", "pw"], &["SELECT", "3"]]),
    ];
    for (url, expected) in cases {
        let (listener, _) = server().await;
        let port = listener.local_addr().unwrap().port();
        let info = url.replace("{}", &port.to_string()).into_connection_info().unwrap();
        let (direct, _server) = tokio::join!(Direct::connect(&info), async {
            let mut server = listener.accept().await.unwrap().0;
            for command in expected {
                assert_eq!(&commands(&mut server, 1).await[0], command, "{url}");
                server.write_all(b"+OK\r\n").await.unwrap();
            }
            server
        });
        assert_eq!(direct.unwrap().db(), if url.ends_with("/3") { 3 } else { 0 }, "{url}");
    }
    let (listener, _) = server().await;
    let port = listener.local_addr().unwrap().port();
    let info = format!("redis://:wrong@127.0.0.1:{port}").into_connection_info().unwrap();
    let (refused, _server) = tokio::join!(Direct::connect(&info), async {
        let mut server = listener.accept().await.unwrap().0;
        commands(&mut server, 1).await;
        server.write_all(b"-WRONGPASS invalid username-password pair\r\n").await.unwrap();
        server
    });
    let error = refused.err().expect("refused");
    assert!(error.to_string().contains("WRONGPASS"), "{error}");
}

#[test]
fn only_plain_tcp_and_resp2_are_driven_here() {
    let serves = |url: &str| Direct::serves(&url.into_connection_info().unwrap());
    assert!(serves("redis://127.0.0.1:6379/2"));
    assert!(!serves("redis://127.0.0.1:6379/?protocol=resp3"));
    assert!(!serves("redis+unix:///tmp/redis.sock"));
    let with = |settings: fn(TcpSettings) -> TcpSettings| {
        let info = "redis://127.0.0.1:6379".into_connection_info().unwrap();
        Direct::serves(&info.set_tcp_settings(settings(TcpSettings::default())))
    };
    assert!(with(|tcp| tcp.set_nodelay(false)));
    assert!(!with(|tcp| tcp.set_keepalive(socket2::TcpKeepalive::new())));
    assert!(!with(|tcp| tcp.set_user_timeout(Duration::from_secs(5))));
}
