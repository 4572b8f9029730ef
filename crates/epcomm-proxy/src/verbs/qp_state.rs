//! The attributes and masks of the RC queue pair's transitions RESET → INIT → RTR → RTS
//! (pure: builds `ibv_modify_qp` arguments, calls nothing).
//!
//! | transition | attribute mask |
//! |------------|----------------|
//! | → INIT | `STATE \| PKEY_INDEX \| PORT \| ACCESS_FLAGS` |
//! | → RTR  | `STATE \| AV \| PATH_MTU \| DEST_QPN \| RQ_PSN \| MAX_DEST_RD_ATOMIC \| MIN_RNR_TIMER` |
//! | → RTS  | `STATE \| TIMEOUT \| RETRY_CNT \| RNR_RETRY \| SQ_PSN \| MAX_QP_RD_ATOMIC` |
//!
//! These are the masks the kernel requires for an RC queue pair (`ib_modify_qp_is_ok`'s table);
//! an extra or missing bit makes `ibv_modify_qp` fail with `EINVAL`.

use std::os::raw::c_int;

use super::endpoint::QpEndpoint;
use super::sys::{self, IbvAhAttr, IbvGid, IbvGlobalRoute, IbvQpAttr};

/// The path and timing parameters of every queue pair of one executor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PathParams {
    /// Local port (1-based).
    pub port: u8,
    /// `enum ibv_mtu` of the path (the port's active MTU by default).
    pub mtu: u32,
    /// Source GID index.
    pub gid_index: u8,
    /// Whether to route by GID (`is_global`): required on RoCE (Ethernet link layer).
    pub global: bool,
    /// Traffic class (RoCE DSCP << 2).
    pub traffic_class: u8,
    /// Service level.
    pub service_level: u8,
    /// Hop limit of the GRH.
    pub hop_limit: u8,
    /// Local ACK timeout exponent (4.096 µs · 2^timeout).
    pub timeout: u8,
    /// Retries on timeout (≤ 7).
    pub retry_cnt: u8,
    /// Retries on RNR NAK (7 = infinite).
    pub rnr_retry: u8,
    /// Minimum RNR NAK timer.
    pub min_rnr_timer: u8,
    /// Outstanding RDMA reads/atomics (initiator and responder).
    pub rd_atomic: u8,
}

impl PathParams {
    /// Defaults for `port`, `mtu`, `gid_index` and `global`: timeout 14 (~67 ms), 7 retries,
    /// infinite RNR retries, traffic class 0, SL 0, hop limit 64, min RNR timer 12, 1
    /// outstanding read/atomic.
    pub fn new(port: u8, mtu: u32, gid_index: u8, global: bool) -> PathParams {
        PathParams {
            port,
            mtu,
            gid_index,
            global,
            traffic_class: 0,
            service_level: 0,
            hop_limit: 64,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
            rd_atomic: 1,
        }
    }
}

/// Remote write and read (and atomics) on this rank's buffer.
pub const REMOTE_ACCESS: c_int = sys::IBV_ACCESS_LOCAL_WRITE
    | sys::IBV_ACCESS_REMOTE_WRITE
    | sys::IBV_ACCESS_REMOTE_READ
    | sys::IBV_ACCESS_REMOTE_ATOMIC;

/// Mask of RESET → INIT.
pub const INIT_MASK: c_int =
    sys::IBV_QP_STATE | sys::IBV_QP_PKEY_INDEX | sys::IBV_QP_PORT | sys::IBV_QP_ACCESS_FLAGS;
/// Mask of INIT → RTR.
pub const RTR_MASK: c_int = sys::IBV_QP_STATE
    | sys::IBV_QP_AV
    | sys::IBV_QP_PATH_MTU
    | sys::IBV_QP_DEST_QPN
    | sys::IBV_QP_RQ_PSN
    | sys::IBV_QP_MAX_DEST_RD_ATOMIC
    | sys::IBV_QP_MIN_RNR_TIMER;
/// Mask of RTR → RTS.
pub const RTS_MASK: c_int = sys::IBV_QP_STATE
    | sys::IBV_QP_TIMEOUT
    | sys::IBV_QP_RETRY_CNT
    | sys::IBV_QP_RNR_RETRY
    | sys::IBV_QP_SQ_PSN
    | sys::IBV_QP_MAX_QP_RD_ATOMIC;

/// One transition: its name for errors, the attributes and the mask.
#[derive(Debug, Clone, Copy)]
pub struct Transition {
    /// The state before.
    pub from: &'static str,
    /// The state after.
    pub to: &'static str,
    /// The attributes.
    pub attr: IbvQpAttr,
    /// The mask.
    pub mask: c_int,
}

/// RESET → INIT on `params.port`, P_Key index 0, remote write/read/atomic allowed.
pub fn to_init(params: &PathParams) -> Transition {
    let attr = IbvQpAttr {
        qp_state: sys::IBV_QPS_INIT,
        pkey_index: 0,
        port_num: params.port,
        qp_access_flags: REMOTE_ACCESS as u32,
        ..IbvQpAttr::default()
    };
    Transition {
        from: "RESET",
        to: "INIT",
        attr,
        mask: INIT_MASK,
    }
}

/// INIT → RTR towards `remote`: its QPN and PSN, addressed by GID (`params.global`) or LID.
pub fn to_rtr(params: &PathParams, remote: &QpEndpoint) -> Transition {
    let grh = if params.global {
        IbvGlobalRoute {
            dgid: IbvGid { raw: remote.gid },
            flow_label: 0,
            sgid_index: params.gid_index,
            hop_limit: params.hop_limit,
            traffic_class: params.traffic_class,
        }
    } else {
        IbvGlobalRoute::default()
    };
    let attr = IbvQpAttr {
        qp_state: sys::IBV_QPS_RTR,
        path_mtu: params.mtu,
        dest_qp_num: remote.qpn,
        rq_psn: remote.psn & PSN_MASK,
        max_dest_rd_atomic: params.rd_atomic,
        min_rnr_timer: params.min_rnr_timer,
        ah_attr: IbvAhAttr {
            grh,
            dlid: remote.lid,
            sl: params.service_level,
            src_path_bits: 0,
            static_rate: 0,
            is_global: u8::from(params.global),
            port_num: params.port,
        },
        ..IbvQpAttr::default()
    };
    Transition {
        from: "INIT",
        to: "RTR",
        attr,
        mask: RTR_MASK,
    }
}

/// RTR → RTS with this queue pair's send PSN `local_psn`.
pub fn to_rts(params: &PathParams, local_psn: u32) -> Transition {
    let attr = IbvQpAttr {
        qp_state: sys::IBV_QPS_RTS,
        timeout: params.timeout,
        retry_cnt: params.retry_cnt,
        rnr_retry: params.rnr_retry,
        sq_psn: local_psn & PSN_MASK,
        max_rd_atomic: params.rd_atomic,
        ..IbvQpAttr::default()
    };
    Transition {
        from: "RTR",
        to: "RTS",
        attr,
        mask: RTS_MASK,
    }
}

/// PSNs are 24 bits.
pub const PSN_MASK: u32 = 0x00ff_ffff;

#[cfg(test)]
mod tests {
    use super::*;

    fn remote() -> QpEndpoint {
        QpEndpoint {
            qpn: 0x11,
            psn: 0x0123_4567,
            gid: [7; 16],
            lid: 9,
            rkey: 1,
            base_addr: 0,
        }
    }

    #[test]
    fn masks_are_the_rc_transition_masks() {
        // Values of verbs.h's enum ibv_qp_attr_mask, spelled out.
        assert_eq!(INIT_MASK, 0x1 | 0x10 | 0x20 | 0x8);
        assert_eq!(
            RTR_MASK,
            0x1 | 0x80 | 0x100 | 0x10_0000 | 0x1000 | 0x2_0000 | 0x8000
        );
        assert_eq!(RTS_MASK, 0x1 | 0x200 | 0x400 | 0x800 | 0x1_0000 | 0x2000);
        // No transition sets a bit of another's attributes.
        assert_eq!(INIT_MASK & RTR_MASK, sys::IBV_QP_STATE);
        assert_eq!(RTR_MASK & RTS_MASK, sys::IBV_QP_STATE);
        assert_eq!(INIT_MASK & RTS_MASK, sys::IBV_QP_STATE);
    }

    #[test]
    fn init_rtr_rts_attributes() {
        let p = PathParams::new(1, 5, 3, true);
        let t = to_init(&p);
        assert_eq!((t.from, t.to, t.mask), ("RESET", "INIT", INIT_MASK));
        assert_eq!(t.attr.qp_state, sys::IBV_QPS_INIT);
        assert_eq!(t.attr.port_num, 1);
        assert_eq!(t.attr.qp_access_flags, 0xf);

        let t = to_rtr(&p, &remote());
        assert_eq!((t.from, t.to, t.mask), ("INIT", "RTR", RTR_MASK));
        assert_eq!(t.attr.qp_state, sys::IBV_QPS_RTR);
        assert_eq!(t.attr.path_mtu, 5);
        assert_eq!(t.attr.dest_qp_num, 0x11);
        assert_eq!(t.attr.rq_psn, 0x23_4567, "24-bit PSN");
        assert_eq!(t.attr.ah_attr.is_global, 1);
        assert_eq!(t.attr.ah_attr.grh.dgid.raw, [7; 16]);
        assert_eq!(t.attr.ah_attr.grh.sgid_index, 3);
        assert_eq!(t.attr.ah_attr.grh.hop_limit, 64);
        assert_eq!(t.attr.ah_attr.dlid, 9);
        assert_eq!(t.attr.ah_attr.port_num, 1);
        assert_eq!(t.attr.max_dest_rd_atomic, 1);
        assert_eq!(t.attr.min_rnr_timer, 12);

        let t = to_rts(&p, 0xff12_3456);
        assert_eq!((t.from, t.to, t.mask), ("RTR", "RTS", RTS_MASK));
        assert_eq!(t.attr.qp_state, sys::IBV_QPS_RTS);
        assert_eq!(t.attr.sq_psn, 0x12_3456);
        assert_eq!(
            (t.attr.timeout, t.attr.retry_cnt, t.attr.rnr_retry),
            (14, 7, 7)
        );
        assert_eq!(t.attr.max_rd_atomic, 1);
    }

    #[test]
    fn infiniband_paths_use_the_lid_without_a_grh() {
        let p = PathParams::new(2, 4, 0, false);
        let t = to_rtr(&p, &remote());
        assert_eq!(t.attr.ah_attr.is_global, 0);
        assert_eq!(t.attr.ah_attr.grh.dgid.raw, [0; 16]);
        assert_eq!(t.attr.ah_attr.dlid, 9);
        assert_eq!(t.attr.ah_attr.port_num, 2);
    }
}
