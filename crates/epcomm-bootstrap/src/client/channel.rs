//! The read side of a rank's connection to the coordinator: [`Channel`] receives the
//! coordinator's answers and judges its silence.
//!
//! Contract: [`Channel::receive`] skips heartbeats, counts every byte received as a sign of
//! life, and fails with [`BootstrapError::PeerUnresponsive`] naming rank 0 when nothing arrived
//! for the peer timeout, with [`BootstrapError::PeerDied`] when the connection closed, and with
//! [`BootstrapError::CoordinatorUnresponsive`] at its deadline. Every failure but the deadline
//! marks the channel broken, so later collectives fail at once.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::link::Link;
use crate::error::{BootstrapError, OpKind, Result};
use crate::wire::{self, FrameError, FrameReader, Progress, ServerMsg};

/// A rank's connection to the coordinator, as used by the thread that runs collectives.
#[derive(Debug)]
pub(super) struct Channel {
    pub(super) link: Arc<Link>,
    pub(super) reader: FrameReader,
    pub(super) next_seq: u64,
    /// Set once the connection can no longer be trusted; every later op fails with it.
    pub(super) broken: Option<String>,
    /// Silence from the coordinator after which a waiting call fails (zero: never).
    pub(super) peer_timeout: Duration,
    /// When bytes last arrived from the coordinator (or the current wait began).
    pub(super) last_heard: Instant,
}

impl Channel {
    /// Reads the next coordinator message other than a heartbeat, waiting until `deadline`.
    /// A closed connection means the coordinator (rank 0) is gone, and so does silence (not a
    /// byte, heartbeats included) for `peer_timeout`; the channel is then marked broken.
    pub(super) fn receive(
        &mut self,
        op: OpKind,
        tag: &str,
        round: u64,
        start: Instant,
        deadline: Instant,
    ) -> Result<ServerMsg> {
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Err(BootstrapError::CoordinatorUnresponsive {
                    op,
                    tag: tag.to_string(),
                    round,
                    waited: start.elapsed(),
                });
            }
            let mut wait = remaining;
            if !self.peer_timeout.is_zero() {
                let silent = self.last_heard.elapsed();
                if silent >= self.peer_timeout {
                    self.broken = Some(format!(
                        "the coordinator (rank 0) sent nothing for {silent:?}"
                    ));
                    return Err(BootstrapError::PeerUnresponsive {
                        rank: 0,
                        op,
                        tag: tag.to_string(),
                        silent_for: silent,
                    });
                }
                wait = wait.min(self.peer_timeout - silent);
            }
            if let Err(source) = self.link.stream.set_read_timeout(Some(wait)) {
                return Err(BootstrapError::Io {
                    op,
                    tag: tag.to_string(),
                    source,
                });
            }
            let last_heard = &mut self.last_heard;
            let mut source = Progress {
                inner: &self.link.stream,
                on_progress: || *last_heard = Instant::now(),
            };
            match self.reader.read_frame(&mut source) {
                Ok(body) => match wire::decode_server(&body) {
                    Ok(ServerMsg::Heartbeat) => {}
                    Ok(msg) => return Ok(msg),
                    Err(e) => {
                        self.broken = Some(format!("undecodable coordinator message: {e}"));
                        return Err(BootstrapError::Protocol {
                            detail: e.to_string(),
                        });
                    }
                },
                Err(e) if e.is_timeout() => {}
                Err(e @ FrameError::TooLarge { .. }) => {
                    self.broken = Some(e.to_string());
                    return Err(BootstrapError::Protocol {
                        detail: e.to_string(),
                    });
                }
                Err(e) => {
                    self.broken = Some(format!("connection to the coordinator lost: {e}"));
                    return Err(BootstrapError::PeerDied {
                        rank: 0,
                        op,
                        tag: tag.to_string(),
                    });
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::{TcpListener, TcpStream};
    use std::thread;

    use super::*;
    use crate::wire::{self, ClientMsg, HelloMsg, MAX_FRAME, MAX_HANDSHAKE_FRAME};
    use crate::{Bootstrap, BootstrapConfig};

    use crate::testing::{LONG, fast_liveness as liveness};

    /// Rank 1 of 2 on this machine.
    fn cfg(port: u16) -> BootstrapConfig {
        BootstrapConfig::single_host(port, 1, 2, LONG)
    }

    /// A hand-driven coordinator: accepts rank 1 and checks its handshake.
    fn fake_coordinator() -> (TcpListener, u16) {
        let listener = TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let port = listener.local_addr().unwrap().port();
        (listener, port)
    }

    fn accept_hello(listener: &TcpListener) -> (TcpStream, FrameReader) {
        let (mut s, _) = listener.accept().unwrap();
        let mut r = FrameReader::new(MAX_HANDSHAKE_FRAME);
        let body = r.read_frame(&mut s).unwrap();
        match wire::decode_hello(&body).unwrap() {
            HelloMsg::Ours(h) => {
                assert_eq!((h.heartbeat_ms, h.peer_timeout_ms), (100, 1000));
            }
            other => panic!("unexpected {other:?}"),
        }
        r.set_max(MAX_FRAME);
        (s, r)
    }

    fn welcome(s: &mut TcpStream) {
        let body = wire::encode_server(&ServerMsg::Welcome {
            protocol: wire::PROTOCOL_VERSION,
            crate_version: wire::CRATE_VERSION.into(),
            world_size: 2,
        });
        wire::write_frame(s, &body).unwrap();
    }

    /// Rank 1 joining the fake coordinator at `port` in a thread, then running `f` on its
    /// `Bootstrap`; the thread returns what `f` returned and how long `f` took.
    fn rank_thread<T: Send + 'static>(
        port: u16,
        f: impl FnOnce(&Bootstrap) -> T + Send + 'static,
    ) -> thread::JoinHandle<(T, Duration)> {
        thread::spawn(move || {
            let bs = Bootstrap::connect_with_liveness(cfg(port), liveness()).expect("connect");
            let start = Instant::now();
            let out = f(&bs);
            (out, start.elapsed())
        })
    }

    /// Reads client messages until the connection closes; returns (heartbeats, ops).
    fn drain(mut s: TcpStream, mut r: FrameReader) -> thread::JoinHandle<(usize, usize)> {
        thread::spawn(move || {
            let (mut beats, mut ops) = (0, 0);
            while let Ok(body) = r.read_frame(&mut s) {
                match wire::decode_client(&body).unwrap() {
                    ClientMsg::Heartbeat => beats += 1,
                    ClientMsg::Op(_) => ops += 1,
                    ClientMsg::Goodbye => break,
                }
            }
            (beats, ops)
        })
    }

    #[test]
    fn silent_coordinator_fails_a_collective_within_the_peer_timeout() {
        let (listener, port) = fake_coordinator();
        let rank = rank_thread(port, |bs| {
            let err = bs.barrier("b").expect_err("the coordinator is silent");
            // Fails at once: the connection is marked broken.
            let again = bs.barrier("c").expect_err("the connection is broken");
            (err, again)
        });
        let (mut s, r) = accept_hello(&listener);
        welcome(&mut s);
        // Read everything (the kernel of a frozen host would ACK it), answer nothing.
        let drained = drain(s, r);
        let ((err, again), waited) = rank.join().unwrap();
        match err {
            BootstrapError::PeerUnresponsive {
                rank: 0,
                op: OpKind::Barrier,
                silent_for,
                ..
            } => assert!(silent_for >= Duration::from_millis(1000), "{silent_for:?}"),
            other => panic!("expected PeerUnresponsive naming rank 0, got {other}"),
        }
        assert!(waited >= Duration::from_millis(950), "{waited:?}");
        assert!(waited < Duration::from_secs(4), "{waited:?}");
        assert!(
            matches!(again, BootstrapError::ConnectionBroken { .. }),
            "{again}"
        );
        // The rank kept sending heartbeats (every 100 ms) while it waited.
        let (beats, ops) = drained.join().unwrap();
        assert_eq!(ops, 1);
        assert!(beats >= 4, "only {beats} heartbeats");
    }

    #[test]
    fn silent_coordinator_fails_connect_within_the_peer_timeout() {
        let (listener, port) = fake_coordinator();
        let rank = thread::spawn(move || {
            let start = Instant::now();
            let err = Bootstrap::connect_with_liveness(cfg(port), liveness()).unwrap_err();
            (err, start.elapsed())
        });
        let (s, r) = accept_hello(&listener);
        let drained = drain(s, r);
        let (err, waited) = rank.join().unwrap();
        assert!(
            matches!(
                err,
                BootstrapError::PeerUnresponsive {
                    rank: 0,
                    op: OpKind::Connect,
                    ..
                }
            ),
            "{err}"
        );
        assert!(waited < Duration::from_secs(4), "{waited:?}");
        drained.join().unwrap();
    }

    #[test]
    fn coordinator_heartbeats_keep_a_waiting_rank_patient() {
        let (listener, port) = fake_coordinator();
        let rank = rank_thread(port, |bs| bs.all_gather("g", b"mine"));
        let (mut s, mut r) = accept_hello(&listener);
        welcome(&mut s);
        let seq = loop {
            match wire::decode_client(&r.read_frame(&mut s).unwrap()).unwrap() {
                ClientMsg::Op(op) => break op.seq,
                ClientMsg::Heartbeat => {}
                ClientMsg::Goodbye => panic!("unexpected goodbye"),
            }
        };
        // Answer only after two peer timeouts, sending heartbeats meanwhile.
        let heartbeat = wire::encode_server(&ServerMsg::Heartbeat);
        let until = Instant::now() + Duration::from_millis(2000);
        while Instant::now() < until {
            wire::write_frame(&mut s, &heartbeat).unwrap();
            thread::sleep(Duration::from_millis(100));
        }
        let ok = wire::encode_server(&ServerMsg::OpOk {
            seq,
            payloads: vec![b"zero".to_vec(), b"mine".to_vec()],
        });
        wire::write_frame(&mut s, &ok).unwrap();
        let drained = drain(s, r);
        let (got, waited) = rank.join().unwrap();
        assert_eq!(got.unwrap(), vec![b"zero".to_vec(), b"mine".to_vec()]);
        assert!(waited >= Duration::from_millis(1900), "{waited:?}");
        drained.join().unwrap();
    }
}
